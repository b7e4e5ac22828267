"""`fusegen` runs its commands under `fusegen.cli.sparse_young_collections` and its builds under `frozen_heap`: the
collector set for a short-lived process while the block runs, and exactly as it was afterwards, also when the block
raises."""

import gc
import weakref

import pytest

from fusegen import cli


def test_frozen_heap_freezes_and_raises_the_young_threshold_only_inside_the_block():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with cli.frozen_heap():
        assert gc.get_freeze_count() > frozen
        assert gc.get_threshold() == (cli.YOUNG_THRESHOLD, *before[1:])
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_frozen_heap_restores_the_collector_when_the_block_raises():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with pytest.raises(KeyError), cli.frozen_heap():
        raise KeyError("a build that fails")
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_a_caller_s_own_frozen_objects_stay_frozen():
    gc.freeze()  # a library user that froze its own heap before calling the CLI in process
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with cli.frozen_heap():
            pass
        # `gc.unfreeze` would leave 0; frozen objects that die meanwhile leave the count, so not exactly `frozen`
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


def test_a_cycle_made_inside_the_block_is_still_collected():
    class Node:
        pass

    with cli.frozen_heap():
        node = Node()
        node.self = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None


def test_every_command_runs_with_sparse_young_collections_from_the_parser_on(monkeypatch):
    """`main` sets the threshold before the parser imports torch and Transformers, and restores it after."""
    seen = []
    parser = cli.make_parser

    def recording_parser():
        seen.append(gc.get_threshold()[0])
        return parser()

    monkeypatch.setattr(cli, "make_parser", recording_parser)
    before = gc.get_threshold()
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert seen == [cli.YOUNG_THRESHOLD]
    assert gc.get_threshold() == before
