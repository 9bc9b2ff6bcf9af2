"""`python -m astrai.train [+experiment=NAME] [overrides]`: train from the Hydra config tree.

With no arguments this runs the tiny_pretrain experiment. See docs/training.md.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from astrai.cli_keys import command_line
from astrai.data.storage import DataError
from astrai.data.storage.h5 import DamagedDataError
from astrai.files import DiskFullError
from astrai.runtime import configure
from astrai.train.runner import (
    CONF_DIR,
    IncompleteCheckpointError,
    NoTrainingBatchesError,
    new_launch,
    register_resolvers,
    train,
)

register_resolvers()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    configure(cfg, lightning=True)  # log level, quiet third parties, torch threads
    try:  # (the config checks ran before: astrai.train.preflight, a Hydra callback)
        return train(cfg)
    except (
        NoTrainingBatchesError,
        DiskFullError,
        IncompleteCheckpointError,
        DamagedDataError,
    ) as err:
        # our message, not a traceback, and a failed status
        raise SystemExit(f"astrai.train: {err}") from None
    except DataError as err:  # a record found bad while preparing (past the pre-run checks)
        raise SystemExit(
            f"astrai.train: {err} (+data.<split>.prepare.skip_bad_lines=true skips such records)"
        ) from None


if __name__ == "__main__":
    new_launch()
    # +experiment= / experiment=, model_path=<dir>, lr= -> "did you mean optim.lr?"
    sys.argv[1:] = command_line("train", sys.argv[1:])
    main()
