"""Source files that `longtrain export` copies into a SparseK model's folder for transformers
(trust_remote_code=True). longtrain itself never imports them; they import transformers."""
