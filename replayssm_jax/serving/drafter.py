"""The engine's n-gram (prompt lookup) drafter: host-side and incremental, one per request.

It proposes what ``models.generate.ngram_drafts`` proposes for the same history (the tokens after
the most recent earlier occurrence of the last n tokens, continued with the same period; the last
token repeated without an occurrence), at O(n) per appended token and O(k) per lookup: an index
maps every n-gram that ends before the last token to its latest start.
"""


class NgramDrafter:
  """Drafts for one growing token sequence (prompt, then generated tokens).

  Usage::

      drafter = NgramDrafter(prompt, ngram=2)
      drafter.drafts(4)          # 4 guesses of the next tokens
      drafter.extend(emitted)    # the tokens the step emitted
  """

  def __init__(self, tokens, *, ngram: int):
    if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1:
      raise ValueError(f"ngram={ngram!r}; expected an int >= 1")
    self.ngram = ngram
    self.tokens: list = []
    self._latest: dict = {}          # n-gram → latest start p with p + n < len(tokens)
    self.extend(tokens)

  def extend(self, tokens) -> None:
    n = self.ngram
    for tok in tokens:
      self.tokens.append(int(tok))
      # The n-gram ending at the previous token now ends before the last one: index it.
      p = len(self.tokens) - 1 - n
      if p >= 0:
        self._latest[tuple(self.tokens[p:p + n])] = p

  def drafts(self, k: int) -> list:
    """k >= 0 guesses of the next tokens (needs at least one token so far)."""
    toks, n = self.tokens, self.ngram
    p = self._latest.get(tuple(toks[-n:])) if len(toks) >= n else None
    if p is None:
      return [toks[-1]] * k
    period = len(toks) - p - n          # >= 1: the occurrence ends before the last token
    return [toks[p + n + i % period] for i in range(k)]
