"""`python -m astrai.extension.build_kernel [-v] [--check]`: compile the CPU attention kernel
(`astrai.extension.cpu_kernels`), as `make setup` does. A failed build warns and exits 0 (the
engine falls back to torch_native) unless `--check` asks for a failure."""

from __future__ import annotations

import logging
import sys

from astrai.extension.cpu_kernels import build

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    unknown = [a for a in argv if a not in ("-v", "--check")]
    if unknown:
        logger.error("usage: python -m astrai.extension.build_kernel [-v] [--check]")
        return 2
    try:
        path = build(verbose="-v" in argv)
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU attention kernel: build failed (%s); torch_native serves", err)
        return 1 if "--check" in argv else 0
    logger.info("CPU attention kernel built: %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
