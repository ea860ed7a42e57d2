"""What the demos (``mmad demo``) and the benchmarks that follow them train: the hash-grid image
config, and the colour field the quick demo learns."""

from __future__ import annotations

# the hash-grid image config of tiny-cuda-nn's samples (data/config_hash.json: 16 levels × 2
# features, base resolution 16, scale 1.5, 64 × 2 ReLU MLP); the table size is an option
IMAGE_CONFIG = {
    "n_input_dims": 2, "n_output_dims": 3,
    "encoding": {"otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2, "log2_hashmap_size": 15,
                 "base_resolution": 16, "per_level_scale": 1.5},
    "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                "n_neurons": 64, "n_hidden_layers": 2},
    "loss": {"otype": "L2"},
    "optimizer": {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15},
    "precision": "fp32", "seed": 1337}


def demo_field(x):
    """A smooth colour field on [0, 1]^2 that the demo model learns."""
    import numpy as np

    r = 0.5 + 0.5 * np.sin(6.0 * x[:, 0]) * np.cos(4.0 * x[:, 1])
    g = 0.5 + 0.5 * np.cos(5.0 * (x[:, 0] + x[:, 1]))
    b = x[:, 0] * x[:, 1]
    return np.stack([r, g, b], axis=1).astype(np.float32)
