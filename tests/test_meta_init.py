"""Building on meta without the initialisers' cost (models/on_meta.py): what a factory's own code sees is unchanged."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

from fsdp_planner.models import load_model, meta_init


class OwnInit(nn.Module):
    """Initialises in its own way, and reads what an initialiser returns."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 4))
        self.shape = tuple(nn.init.trunc_normal_(self.w, std=0.02).shape)
        with torch.no_grad():
            self.w.mul_(2.0)


def test_fills_of_meta_tensors_are_skipped_and_restored_after():
    originals = (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_)
    with meta_init():
        lin = nn.Linear(4, 4)
        own = OwnInit()
        real = nn.init.ones_(torch.empty(3, device="cpu"))  # a real tensor is still filled
    assert lin.weight.is_meta and lin.weight._version == 0  # no fill wrote it
    assert own.w.is_meta and own.shape == (8, 4) and own.w._version == 1  # the factory's own mul_ ran
    assert torch.equal(real, torch.ones(3))
    assert (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_) == originals
    with torch.device("meta"):
        assert nn.Linear(4, 4).weight._version > 0  # what meta_init saves: the fills do run without it


def test_the_collector_is_paused_while_building_only():
    assert gc.isenabled()
    with meta_init():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_load_model_builds_on_meta_with_it():
    lm = load_model("seed-net")
    assert all(p.is_meta and p._version == 0 for p in lm.model.parameters())
