"""Progress output: a tqdm bar on rank 0, or plain log lines every N updates."""

import logging

from tqdm import tqdm

logger = logging.getLogger("hetseq.progress")


def format_stats(stats):
    parts = []
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
        parts.append(f"{key}={value}")
    return " | ".join(parts)


class Progress:
    """Wraps the update loop of one epoch.

    ``log(stats, update)`` is called after every update; ``summary`` at the end.
    """

    def __init__(self, total, prefix, is_main, use_bar, log_interval):
        self.prefix = prefix
        self.is_main = is_main
        self.log_interval = max(1, log_interval)
        self.bar = tqdm(total=total, desc=prefix, leave=False, dynamic_ncols=True) \
            if is_main and use_bar else None

    def log(self, stats, update, steps=1):
        """After update ``update``, which covered ``steps`` updates (a round)."""
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v
                                  for k, v in stats.items()}, refresh=False)
        elif update // self.log_interval > (update - steps) // self.log_interval:
            logger.info("%s | %s", self.prefix, format_stats(stats))

    def summary(self, stats):
        if self.bar is not None:
            self.bar.close()
        if self.is_main:
            logger.info("%s | %s", self.prefix, format_stats(stats))
