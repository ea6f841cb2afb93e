"""Command-line entry points: ``lq-train`` (Hydra app) and ``lq-cli`` (LightningCLI with the callbacks)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from lq.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="pkg://lq.conf", config_name="train")
def _train(cfg: DictConfig) -> None:
    from lq.pipeline import run_job

    job = OmegaConf.to_object(cfg)  # builds the dataclasses: bad values fail here, naming the field
    run_job(job)


def train() -> None:
    """``lq-train [hydra overrides]``: the whole pipeline on the configured model and data.

    The current directory is importable, as with ``python -m``, so ``model._target_=my_pkg.MyModule``
    finds a ``my_pkg.py`` next to where you run it.
    """
    import os

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    _train()


def lightning_cli(args=None) -> None:
    """``lq-cli fit --model ... --data ... --trainer.callbacks+=lq.QuantCallback``: plain LightningCLI.

    Any LightningModule/DataModule import path works for ``--model``/``--data``;
    the quantization callbacks are configured with their typed arguments,
    e.g. ``--trainer.callbacks.calib.method=entropy``.
    """
    import torch
    from lightning.pytorch.cli import LightningCLI

    torch.set_flush_denormal(True)
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    sys.exit(train())
