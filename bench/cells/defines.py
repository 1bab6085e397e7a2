import math


class Schedule:
    """A warm-up, then a cosine learning-rate schedule."""

    def __init__(self, base, warmup, total):
        self.base, self.warmup, self.total = base, warmup, total

    def __call__(self, step):
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.base * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def clipped(values, limit):
    return [max(-limit, min(limit, v)) for v in values]


schedule = Schedule(0.5, warmup=10, total=100)
rates = clipped([schedule(step) for step in range(0, 100, 25)], 0.4)
