"""`python -m astrai.train [experiment=NAME] [overrides]`: train from the Hydra config tree.

With no arguments this runs the tiny_pretrain experiment. See docs/training.md.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from astrai.train.runner import (
    CONF_DIR,
    new_launch,
    register_resolvers,
    train,
)

register_resolvers()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    new_launch()
    main()
