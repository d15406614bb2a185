"""The configuration reference: every config field documented, docs/configuration.md in sync
with the docstrings, ``prism-launch --help-config SECTION``."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import prism_launch.config as config_pkg
from prism_launch.config import reference

ROOT = Path(__file__).resolve().parents[3]


def _config_classes():
    for info in pkgutil.iter_modules(config_pkg.__path__):
        mod = importlib.import_module(f"prism_launch.config.{info.name}")
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and (
                    dataclasses.is_dataclass(obj) or isinstance(obj, enum.EnumMeta)):
                yield f"{mod.__name__}.{name}", obj


def test_every_config_field_and_choice_has_a_docstring():
    classes = dict(_config_classes())
    assert "prism_launch.config.root.PrismConfig" in classes and "prism_launch.config.plan.RankPlan" in classes
    missing = {name: miss for name, cls in classes.items() if (miss := reference.missing_docs(cls))}
    assert not missing, ("config fields without an attribute docstring (write one under each field): "
                         f"{missing}")


def test_missing_docs_finds_an_undocumented_field():
    @dataclasses.dataclass
    class Sample:
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert reference.missing_docs(Sample) == ["bare"]


def test_docs_configuration_md_is_generated_from_the_docstrings():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == reference.markdown(), (
        f"docs/configuration.md is out of date with the config docstrings: regenerate it with "
        f"`{reference.REGENERATE}`")
    assert reference.REGENERATE in page.read_text().splitlines()[0]


def test_reference_lists_every_leaf_key_with_its_default():
    keys = {f.key: f for f in reference.fields_of(config_pkg.PrismConfig)}
    assert keys["capture.payload"].default == "auto"
    assert [v for v, _ in keys["capture.payload"].choices] == ["auto", "exact", "full", "none"]
    assert all(doc for _, doc in keys["capture.payload"].choices)
    assert keys["sandbox.ranks"].default == "[0]"
    assert "emulate.prefetch.pool_mib" in keys and "cluster.gpus_per_node" in keys
    assert not any(k in keys for k in ("capture", "emulate.prefetch", "cluster"))  # sections are flattened


def test_help_config_prints_one_section(capsys):
    from prism_launch.cli import main

    assert main(["--help-config", "sandbox"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sandbox.ranks = [0]")
    assert "Logical ranks that run the real program" in out
    assert "capture." not in out


def test_help_config_names_the_sections_for_an_unknown_one(capsys):
    from prism_launch.cli import main

    assert main(["--help-config", "captur"]) == 2
    err = capsys.readouterr().err
    assert "'captur'" in err and "capture" in err and "emulate" in err
