"""Lightning's `WandbLogger` without the `anonymous` argument it always passes to
`wandb.init`: wandb (0.23 and later) warns "The anonymous setting has no effect and will be
removed" for any value given, `None` included, and a user of ours cannot act on that line
(wandb/wandb#10909 names Lightning as the integration that passes it). Importing this module
imports Lightning: `astrai.train.wandb_run` imports it when it builds the logger.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

__all__ = ["WandbLogger"]


class WandbLogger(LightningWandbLogger):
    """`lightning.pytorch.loggers.WandbLogger` that leaves `anonymous` to wandb's default."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self._wandb_init.get("anonymous") is None:  # never asked for: wandb's default
            self._wandb_init.pop("anonymous", None)
