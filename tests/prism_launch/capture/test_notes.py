"""A staged region's free waits for the trace's notes of it (:meth:`TraceNotes.after_notes`),
including notes deferred until after the replies, without the coordinator blocking on them."""

import functools
import threading

import torch

from prism_launch.capture.notes import TraceNotes


def Notes():
    return TraceNotes(frozenset({0}), None, {"digest": 0.0, "copy": 0.0, "record": 0.0}, lambda nbytes: None)


def test_a_free_waits_for_the_notes_submitted_and_deferred_before_it(monkeypatch):
    import prism_launch.capture.notes as notes

    gate = threading.Event()
    real = notes._summary
    calls = []

    def slow(tensors, stats):  # the first note is quick, the second waits for the gate
        calls.append(1)
        if len(calls) > 1:
            gate.wait(10)
        return real(tensors, stats)

    monkeypatch.setattr(notes, "_summary", slow)
    n = Notes()
    rows = [{}, {}]
    n.summarize(0, rows[0], {}, [torch.ones(4)], stats=False)  # submitted now
    # a note deferred past the replies, then the free of the region both read
    n.defer(functools.partial(n.summarize, stats=False), (0, rows[1], {}, [torch.ones(4)]))
    freed = []
    n.after_notes(lambda: freed.append(True))
    n._summaries[0][0].result()
    n.drain()
    assert "digests" in rows[0]["extra"] and "extra" not in rows[1]
    assert not freed  # the deferred note still reads the region; the coordinator did not wait for it
    gate.set()
    n.drain(wait=True)
    assert freed == [True] and "digests" in rows[1]["extra"]
    n.close()
