"""A real KV-aware router fed by kvcore's events: NVIDIA Dynamo's standalone KV indexer (issue 15).

The indexer (``ai-dynamo-runtime``, pinned in scripts/install-dynamo.sh, installed in its own
venv by ``make install-router``) runs as a subprocess and subscribes to a kvcore
``ZmqEventPublisher``; at every checkpoint its overlap score for a prompt is compared with the
engine's own hit length (tests/router_harness.py says how).

With the reference's events (the default), a hash cached twice (two requests looked the prompt
up before either allocated) is reported stored twice and removed when either copy is evicted,
so the router drops a prefix the engine still serves. ``exact_router_events=True`` reports only
the first copy stored and the last copy removed, and the router stays right.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from router_harness import (
    DynamoIndexer,
    Engine,
    RouterFeed,
    RouterSetupError,
    duplicate_copies_scenario,
    dynamo_python,
    random_scenario,
    running_indexer,
)

SEED = 6
STEPS = 64
BLOCK_SIZE = 4

_models = itertools.count()


@pytest.fixture(scope="module")
def indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    """One indexer process for the module (each engine registers its own model name)."""
    try:
        python = dynamo_python()
    except RouterSetupError as err:
        missing = str(err)
    else:
        log = Path(tmp_path_factory.mktemp("dynamo-indexer")) / "indexer.log"
        with running_indexer(python, log) as idx:
            yield idx
        return
    pytest.fail(missing, pytrace=False)  # not a skip: CI installs it (make install-router)


@pytest.fixture
def make_engine(indexer: DynamoIndexer, hash_seed: str) -> Iterator[Callable[[int, bool], Engine]]:
    """Builds engines whose events feed the indexer; their publishers are shut at teardown."""
    feeds: list[RouterFeed] = []

    def make(num_blocks: int, exact_router_events: bool) -> Engine:
        feed = RouterFeed(indexer, f"kvcore-{next(_models)}", BLOCK_SIZE)
        feeds.append(feed)
        return Engine(feed, num_blocks, exact_router_events=exact_router_events)

    yield make
    for feed in feeds:
        feed.close()


def _find(engine: Engine, what: str, label: str) -> tuple[int, int]:
    (check,) = [c for c in engine.checks if c.what == what and c.label == label]
    return check.engine_blocks, check.router_blocks


def test_default_events_mislead_the_router(make_engine: Callable[[int, bool], Engine]) -> None:
    """With the reference's events the router loses a prefix the engine still serves.

    This is what makes the test below meaningful: the harness sees the router being wrong.
    """
    dup = make_engine(16, False)
    duplicate_copies_scenario(dup)
    # Both copies cached: right. A's copies of P's 2nd and 3rd blocks evicted: BlockRemoved for
    # their hashes, so the router keeps only P's 1st block while the engine hits all 3 (B's).
    assert _find(dup, "A and B finish", "P") == (3, 3), dup.summary()
    assert _find(dup, "C evicts A's copy of P", "P") == (3, 1), dup.summary()
    # Both copies gone: right again.
    assert _find(dup, "D evicts B's copy of P", "P") == (0, 0), dup.summary()

    rand = make_engine(24, False)
    random_scenario(rand, SEED, STEPS)
    print(f"default events, duplicate scenario: {dup.summary()}")
    print(f"default events, random scenario (seed {SEED}): {rand.summary()}")
    first_dup = rand.ledger.first_duplicate_step
    assert first_dup is not None, "the scenario cached no duplicate copy"
    # Right until a hash is cached twice; then wrong, always by forgetting cached blocks.
    assert all(c.ok for c in rand.checks if c.step < first_dup), rand.summary()
    bad = [c for c in rand.checks if not c.ok]
    assert bad, "expected the duplicate copies to mislead the router:\n" + rand.summary()
    assert all(c.router_blocks < c.engine_blocks for c in bad), rand.summary()


def test_exact_router_events_keep_the_router_right(
    make_engine: Callable[[int, bool], Engine],
) -> None:
    """``exact_router_events=True``: the router's overlap equals the engine's hit at every check."""
    dup = make_engine(16, True)
    duplicate_copies_scenario(dup)
    assert _find(dup, "C evicts A's copy of P", "P") == (3, 3), dup.summary()
    assert all(c.ok for c in dup.checks), dup.summary()

    # The scenario of the test above, duplicate copies included: the flag changes only the
    # events, so the engine answers as it does with the default events.
    rand = make_engine(24, True)
    random_scenario(rand, SEED, STEPS)
    print(f"exact events, duplicate scenario: {dup.summary()}")
    print(f"exact events, random scenario (seed {SEED}): {rand.summary()}")
    assert all(c.ok for c in rand.checks), rand.summary()
    ref = make_engine(24, False)
    random_scenario(ref, SEED, STEPS)
    assert ref.ledger.first_duplicate_step is not None, "the scenario cached no duplicate copy"
    assert [c.engine_blocks for c in rand.checks] == [c.engine_blocks for c in ref.checks]
    # The events themselves: a hash stored only while not reported cached, removed only once.
    assert not dup.ledger.violations, dup.ledger.violations[:10]
    assert not rand.ledger.violations, rand.ledger.violations[:10]
