"""integrations.import_hooks.replaces: a function or method swapped for a wrapper of it once,
whoever asks again; a method stays a method; the original stays reachable."""

import types

from integrations.import_hooks import MARK, replaces


def test_a_method_is_replaced_once_and_stays_a_method():
    class Box:
        def get(self, k):
            """The value under k."""
            return {"a": 1}[k]

    original = Box.get
    calls = []

    for _ in range(2):  # a second patch of the same attribute changes nothing
        @replaces(Box, "get")
        def get(orig, self, k):
            calls.append(k)
            return orig(self, k) * 10

    assert Box().get("a") == 10 and calls == ["a"]
    assert getattr(Box.get, MARK) and Box.get.__wrapped__ is original
    assert Box.get.__name__ == "get" and Box.get.__doc__ == "The value under k."


def test_a_module_function_and_an_absent_one():
    mod = types.ModuleType("m")
    mod.f = lambda x, y=1: x + y
    made = replaces(mod, "f")(lambda orig, x, y=1: orig(x, y=y) * 2)
    assert made is mod.f and mod.f(1, y=2) == 6
    assert replaces(mod, "missing")(lambda orig: None) is None and not hasattr(mod, "missing")


def test_a_static_or_class_method_is_refused_by_name():
    import pytest

    class Box:
        @staticmethod
        def make():
            return 1

    with pytest.raises(TypeError, match="staticmethod or classmethod"):
        replaces(Box, "make")(lambda orig: orig())
    assert Box.make() == 1
