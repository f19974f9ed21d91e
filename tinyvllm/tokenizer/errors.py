"""The one exception type the tokenizer package raises."""


class TokenizerError(ValueError):
  """A tokenizer could not be loaded, or was used in a way it does not support."""
