"""Token controls on the device: each row's allowed tokens (a bitmask) and its sparse logit bias, applied to the logits
before the penalties and the sampler (vLLM v1's order: allowed tokens, bad words, logit bias, min_tokens, then
penalties, temperature and the filters).

The bitmask is llguidance's layout: [rows, ceil(V / 32)] int32, bit t % 32 of word t // 32 set when token t is allowed
(structured output's grammar masks, allowed_token_ids). The bias is per row a short list of (row * V + token, value)
pairs (logit_bias; -inf for a banned token: bad words, EOS before min_tokens), scattered into a dense [B, V] like the
penalties. Both travel in the step's packed int32 input; a step whose rows use neither has neither (and its layout,
hence its capture, is the one it had without them).
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.layers.scatter import scatter_rows


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
  """bool [B, V] from the bitmask [B, W] int32 (W * 32 >= V)."""
  b, words = bitmask.shape
  shifts = Tensor.arange(32, dtype=dtypes.int32).to(bitmask.device).reshape(1, 1, 32)
  bits = (bitmask.reshape(b, words, 1) >> shifts) & 1   # an arithmetic shift, but & 1 keeps only the bit asked for
  return bits.reshape(b, words * 32)[:, :vocab_size] != 0


def dense_bias(index: Tensor, value: Tensor, rows: int, vocab_size: int) -> Tensor:
  """float32 [rows, V]: value[i, j] at flat position index[i, j] (row * V + token; -1: none), 0 elsewhere."""
  dense = Tensor.zeros(rows * vocab_size, 1, dtype=dtypes.float32, device=index.device).contiguous()
  return scatter_rows(dense, index.reshape(-1), value.reshape(-1, 1)).reshape(rows, vocab_size)


def apply_token_controls(logits: Tensor, bitmask: Tensor | None = None, bias: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """float32 logits [B, V] with the disallowed tokens at -inf and the bias added."""
  rows, vocab = logits.shape
  logits = logits.float()
  if bias is not None: logits = logits + dense_bias(*bias, rows, vocab)
  if bitmask is not None: logits = allowed_tokens(bitmask, vocab).where(logits, float("-inf"))
  return logits
