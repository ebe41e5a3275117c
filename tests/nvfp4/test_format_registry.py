"""What each registered :class:`nvfp4.formats.Format` answers for itself (issue #48): bytes per weight, its model
card, its compressed-tensors config and the one check that reads such a config back."""

from __future__ import annotations

import pytest
from nvfp4.card import write_model_card
from nvfp4.formats import FORMATS, compressed_tensors_format
from nvfp4.hf import NVFP4Config, compressed_tensors_config


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_every_format_answers_for_itself(fmt, tmp_path):
    assert fmt.bytes_per_weight == 0.5 + fmt.scale_dtype.itemsize / fmt.group_size  # nvfp4 0.5625, mxfp4 0.53125
    assert fmt.bytes_per_tensor == (4 if fmt.has_global_scale else 0)
    card = write_model_card(tmp_path, base_model="org/model", method="rtn", format=fmt).read_text()
    assert fmt.ct_scheme in card and "org/model" in card
    qc = compressed_tensors_config(["lm_head"], format=fmt)
    assert compressed_tensors_format(qc) is fmt
    config = NVFP4Config(format=fmt)
    assert config.weight_format is fmt and config.to_dict()["format"] == fmt.ct_format  # the serialized name
    with pytest.raises(ValueError, match="quantizes activations"):
        bad = dict(qc, config_groups={"g": {**qc["config_groups"]["group_0"], "input_activations": {"num_bits": 4}}})
        compressed_tensors_format(bad)
