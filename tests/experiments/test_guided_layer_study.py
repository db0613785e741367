"""The guided-layer study entry point writes its table, per-layer rows and plot."""

from __future__ import annotations

import json

from configs import guided_layer_study
from experiments.guided_layer_study import layers_text, write
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.gap import GapConfig
from trace_jax.tables.layer_study import BF16_PAIR, RANDOM_INIT, LayerStudyResult, layer_sets


def test_layers_text():
    texts = [layers_text(s) for s in layer_sets(8).values()]
    assert texts == ["-", "4-7", "0-3", "1,3,..,7", "0-7"]
    assert layers_text((0, 2, 5)) == "0,2,5" and layers_text((3,)) == "3"


def test_written_results(tmp_path):
    config = ExperimentConfig.from_config_dict(guided_layer_study.get_config())
    rows, per_layer, policies = [], [], []
    for policy, n in ((RANDOM_INIT, 2), (RANDOM_INIT, 4), ("SFT", 4)):
        policies.append({"policy": policy, "n_layers": n, "sampled": f"{policy} sampled"})
        for name, layers in {BF16_PAIR: (), **layer_sets(n)}.items():
            gap = 1.5 if policy == RANDOM_INIT else 0.5
            rows.append({"policy": policy, "n_layers": n, "layer_set": name,
                         "guided_layers": list(layers),
                         "guidance_bytes_per_token": 10.0 * len(layers), "logp_gap_mean": 0.1,
                         "gap_over_bf16": gap, "code_mismatch": 0.01})  # fmt: skip
            per_layer += [
                {"policy": policy, "n_layers": n, "layer_set": name, "layer": i,
                 "guided": i in layers, "code_mismatch": 0.0 if i in layers else 0.02}
                for i in range(n) if name != BF16_PAIR
            ]  # fmt: skip
    result = LayerStudyResult(rows, per_layer, policies, True)
    paths = write(config, GapConfig(), result, outdir=str(tmp_path), name="study")
    saved = json.loads((tmp_path / "study.json").read_text())
    assert saved["rows"] == rows and saved["per_layer"] == per_layer
    assert saved["policies"] == policies
    md = (tmp_path / "study.md").read_text()
    assert paths["md"] == str(tmp_path / "study.md")
    assert "| random init | 4 | deeper half | 2-3 | 20 | 0.1 | 1.5 |" in md
    assert "| SFT | 4 | deeper half | 2-3 | 20 | 0.1 | 0.5 |" in md
    assert "SFT, 4 layers: SFT sampled" in md and "beside trained ones" in md
    assert "routing replay on" in md
    assert (tmp_path / "study.png").read_bytes()[:4] == b"\x89PNG"
