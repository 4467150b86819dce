"""A step-time bound on prefill: while requests are decoding, each step takes only as many
prefill tokens as the measured cost of a step lets it finish within a target time, so that a
burst of new prompts never holds a running stream's next token for longer than that.

The cost model is a line, step seconds = a + b x tokens, fitted by least squares over the steps
seen, each weight decaying by DECAY per step (recent steps count most: the cost moves with
context lengths and with what else runs on the machine). Torch-free; the engine feeds it the
time of each step it collects.
"""
from __future__ import annotations

DECAY = 0.97
# Steps whose fit is trusted: fewer observations, or a line that does not rise with tokens,
# give no limit rather than a guess.
MIN_WEIGHT = 4.0
# A step measured at more than this many times the fit's prediction counts as this many.
OUTLIER = 3.0


class StepTimeBudget:
    """prefill_limit(decode_tokens) -> the prefill tokens a step beside that many decode
    tokens may take (None: no limit), from observe(tokens, seconds) of the steps so far."""

    def __init__(self, target_s: float, min_chunk: int) -> None:
        if target_s <= 0:
            raise ValueError(f"the step time target must be positive, got {target_s}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        self.target_s = target_s
        self.min_chunk = min_chunk
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        # The last trusted fit: steps of one size for a while (no slope to read) keep it.
        self._last: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        assert tokens >= 0 and seconds >= 0
        fit = self.fit
        if fit is not None:  # a stalled step (a pause, a stopped process) is not its cost
            seconds = min(seconds, OUTLIER * (fit[0] + fit[1] * tokens))
        self._w = self._w * DECAY + 1.0
        self._x = self._x * DECAY + tokens
        self._y = self._y * DECAY + seconds
        self._xx = self._xx * DECAY + tokens * tokens
        self._xy = self._xy * DECAY + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(a, b): seconds per step and per token, or None while the fit is not trusted."""
        if self._w < MIN_WEIGHT:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-9:
            return None  # every step had the same size: no slope to read
        b = (self._xy / self._w - mean_x * mean_y) / var
        if b <= 0:
            return None
        self._last = max(mean_y - b * mean_x, 0.0), b
        return self._last

    @property
    def fit(self) -> tuple[float, float] | None:
        """The line now, or the last trusted one."""
        return self.line() or self._last

    def prefill_limit(self, decode_tokens: int) -> int | None:
        """None without decodes (no stream waits on the step) or without a trusted fit. 0
        when the decodes alone fill the target: new prompts wait for running requests to
        finish, which bounds how many streams share a step. Where even one decode overruns
        the target (it cannot be met), min_chunk, so that prompts still progress."""
        if decode_tokens <= 0:
            return None
        fit = self.fit
        if fit is None:
            return None
        a, b = fit
        if a + b * (1 + self.min_chunk) >= self.target_s:
            return self.min_chunk
        return max(int((self.target_s - a) / b) - decode_tokens, 0)
