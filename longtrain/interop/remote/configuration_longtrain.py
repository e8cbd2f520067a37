"""The configuration of a SparseK model exported by longtrain (loaded with trust_remote_code=True).

config.json is the standard family's (Llama, Qwen2, Mistral or GPT-NeoX) with two extra keys that
longtrain writes: `longtrain_sparsek` (attention type, k, w, variant, scoring settings, the layout and
what varies inside it) and `longtrain_rope`
(the RoPE inverse frequencies longtrain uses, scaling included, and the factor on cos and sin).
"""

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as PreTrainedConfig


class LongtrainConfig(PreTrainedConfig):
    model_type = "longtrain"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        rms_norm_eps=1e-6,
        layer_norm_eps=None,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        longtrain_sparsek=None,
        longtrain_rope=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.layer_norm_eps = layer_norm_eps
        self.norm_eps = layer_norm_eps if layer_norm_eps is not None else rms_norm_eps  # GPT-NeoX's, else Llama's
        self.max_position_embeddings = max_position_embeddings
        self.longtrain_sparsek = longtrain_sparsek or {}
        self.longtrain_rope = longtrain_rope or {}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
