"""The one exception type of the data pipeline.

Every problem with the user's input (a path, a file, a tokenizer) becomes a
DataError whose message names the problem and the fix; the CLI prints it
without a traceback.
"""


class DataError(Exception):
    """Bad input to the data pipeline; the message is meant for the user."""
