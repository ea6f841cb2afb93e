"""Loading a checkpoint through lq never runs code from the file, and bad files get a clear error."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import lq
from lq.checkpoint import CheckpointError, load_quantized_state, read_checkpoint


class _RunsCodeOnLoad:
    """What a malicious checkpoint carries: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _plain_checkpoint() -> dict:
    return {"state_dict": {"0.weight": torch.zeros(2, 2)}, "lq": {"quant_class": "Int8PerChannelConfig", "quant": {}},
            "hyper_parameters": {}}


def _malicious(tmp_path):
    marker = str(tmp_path / "pwned")
    ckpt = _plain_checkpoint()
    ckpt["hyper_parameters"] = {"payload": _RunsCodeOnLoad(marker)}
    path = tmp_path / "evil.ckpt"
    torch.save(ckpt, path)
    return path, marker


@pytest.mark.parametrize("loader", ["load_quantized", "load_quantized_state", "read_checkpoint"])
def test_malicious_checkpoint_runs_nothing_through_any_lq_loader(tmp_path, loader):
    path, marker = _malicious(tmp_path)
    with pytest.raises(CheckpointError, match=r"weights_only=True .*trusted=True"):
        if loader == "load_quantized":
            lq.load_quantized(nn.Linear, str(path))
        elif loader == "load_quantized_state":
            load_quantized_state(nn.Sequential(nn.Linear(2, 2)), str(path))
        else:
            read_checkpoint(path)
    assert not os.path.exists(marker)


def test_trusted_is_an_explicit_opt_in(tmp_path):
    path, marker = _malicious(tmp_path)
    read_checkpoint(path, trusted=True)
    assert os.path.exists(marker)  # what weights_only=True protects everyone else from


def test_plain_checkpoint_loads_with_weights_only(tmp_path):
    torch.save(_plain_checkpoint(), tmp_path / "ok.ckpt")
    assert torch.equal(read_checkpoint(tmp_path / "ok.ckpt")["state_dict"]["0.weight"], torch.zeros(2, 2))


def test_empty_truncated_and_foreign_files_say_what_they_are(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.ckpt is empty, not a readable checkpoint.*save_checkpoint"):
        read_checkpoint(tmp_path / "empty.ckpt")
    torch.save(_plain_checkpoint(), tmp_path / "full.ckpt")
    data = (tmp_path / "full.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut.ckpt is not a readable checkpoint: it is truncated"):
        read_checkpoint(tmp_path / "cut.ckpt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        read_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        read_checkpoint(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("content", [b"a note to self\n", b"notes about the run\n", b'{"epoch": 3}', b".\n",
                                     b"(.", bytes(range(256)) * 4], ids=["text-a", "text-n", "json", "dot", "mark",
                                                                         "bytes"])
@pytest.mark.parametrize("loader", ["load_quantized", "read_checkpoint"])
def test_any_file_that_is_not_a_checkpoint_gets_the_named_error(tmp_path, content, loader):
    """``lq.load_quantized(Model, "notes.ckpt")`` on a text file raised torch's unpickler's own ``IndexError: pop
    from empty list`` (text starting with a pickle opcode such as ``a``); a JSON file or other text got a message
    about Python objects it does not hold. Every non-checkpoint gets CheckpointError naming the file."""
    path = tmp_path / "notes.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"notes.ckpt is not a (torch|readable) checkpoint"):
        if loader == "load_quantized":
            lq.load_quantized(nn.Linear, str(path))
        else:
            read_checkpoint(path)


def test_a_pickle_of_the_wrong_kind_is_not_called_a_code_risk(tmp_path):
    """A legacy (non-zip) pickle that the weights-only reader rejects for a bad opcode is damaged, not malicious."""
    path = tmp_path / "odd.ckpt"
    path.write_bytes(b"\x80\x02" + bytes([149]) + b".")
    with pytest.raises(CheckpointError, match="odd.ckpt is not a readable checkpoint") as e:
        read_checkpoint(path)
    assert "trusted=True" not in str(e.value)
