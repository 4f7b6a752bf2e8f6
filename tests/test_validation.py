"""PRODUCT.md §8: bad input gets a clear error at the call site and changes nothing.

Also registration rules, pool names, RetryBehavior checks, and "a worker runs
only functions registered in its App".
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
import uuid
from urllib.parse import quote

import pytest

import workpool
from conftest import Recorder, assert_pool_empty, background_worker, run_until_idle, wait_for
from workpool import RetryBehavior
from workpool.store import open_store
from workpool.store.sqlite import SqliteStore
from workpool.store.sqlite.store import MMAP_BYTES

pytestmark = pytest.mark.timeout(60)

LIMIT = 1_000_000


@pytest.fixture
def fns(app, rec: Recorder):
    @app.action(name="job")
    def job(**kwargs) -> None:
        rec.add(kind="job", kwargs=kwargs)

    @app.mutation(name="mut")
    def mut(tx, **kwargs) -> None:
        rec.add(kind="mut")

    @app.query(name="qry")
    def qry(tx, **kwargs) -> None:
        return None

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="done")

    return {"job": job, "mut": mut, "qry": qry, "record": record}


def _nothing_stored(app, pool, rec: Recorder) -> None:
    assert_pool_empty(pool)
    run_until_idle(app, timeout=15)
    assert rec.calls == []
    assert pool.stats().completed == 0


def _is_workpool_error(exc: BaseException) -> None:
    assert isinstance(exc, workpool.WorkpoolError), type(exc).__mro__


class NotJson:
    pass


@pytest.mark.parametrize(
    "args",
    [
        {"x": NotJson()},
        {"x": {1, 2}},
        {"x": b"bytes"},
        {"x": time},
    ],
    ids=["object", "set", "bytes", "module"],
)
def test_unserialisable_args_are_type_errors_and_store_nothing(app, fns, rec, args):
    pool = app.pool("bad")
    with pytest.raises(TypeError) as info:
        pool.enqueue_action(fns["job"], args)
    _is_workpool_error(info.value)
    with pytest.raises(TypeError):
        pool.enqueue_action_batch(fns["job"], [{"x": 1}, args, {"x": 2}])
    with pytest.raises(TypeError):
        pool.enqueue_mutation(fns["mut"], args)
    with pytest.raises(TypeError):
        pool.enqueue_query_batch(fns["qry"], [args])
    _nothing_stored(app, pool, rec)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_json_numbers_are_rejected(app, fns, rec, value):
    pool = app.pool("bad")
    with pytest.raises((TypeError, ValueError)) as info:
        pool.enqueue_action(fns["job"], {"x": value})
    _is_workpool_error(info.value)
    _nothing_stored(app, pool, rec)


@pytest.mark.parametrize("args", [[1, 2], "x=1", 5, ("a",)], ids=["list", "str", "int", "tuple"])
def test_args_must_be_a_dict(app, fns, rec, args):
    pool = app.pool("bad")
    with pytest.raises(TypeError) as info:
        pool.enqueue_action(fns["job"], args)
    _is_workpool_error(info.value)
    _nothing_stored(app, pool, rec)


def test_args_list_of_a_batch_must_be_a_list(app, fns, rec):
    pool = app.pool("bad")
    with pytest.raises(TypeError):
        pool.enqueue_action_batch(fns["job"], {"x": 1})
    _nothing_stored(app, pool, rec)


def test_unserialisable_context_is_a_type_error(app, fns, rec):
    pool = app.pool("bad")
    with pytest.raises(TypeError) as info:
        pool.enqueue_action(fns["job"], {}, on_complete=fns["record"], context={"o": NotJson()})
    _is_workpool_error(info.value)
    _nothing_stored(app, pool, rec)


def test_args_over_the_size_limit(app, fns, rec):
    pool = app.pool("bad")
    big = {"blob": "x" * LIMIT}
    with pytest.raises(ValueError) as info:
        pool.enqueue_action(fns["job"], big)
    _is_workpool_error(info.value)
    with pytest.raises(ValueError):
        pool.enqueue_action_batch(fns["job"], [{}, big])
    with pytest.raises(ValueError):
        pool.enqueue_mutation(fns["mut"], big)
    # multi-byte characters count in bytes, not characters
    with pytest.raises(ValueError):
        pool.enqueue_action(fns["job"], {"blob": "é" * (LIMIT // 2 + 10)})
    _nothing_stored(app, pool, rec)


def test_context_over_the_size_limit(app, fns, rec):
    pool = app.pool("bad")
    with pytest.raises(ValueError) as info:
        pool.enqueue_action(fns["job"], {}, on_complete=fns["record"], context="y" * (LIMIT + 1))
    _is_workpool_error(info.value)
    _nothing_stored(app, pool, rec)


def test_payloads_just_under_the_limit_are_accepted(app, fns, rec):
    pool = app.pool("big_ok")
    blob = "x" * (LIMIT - 1000)
    wid = pool.enqueue_action(fns["job"], {"blob": blob}, on_complete=fns["record"], context=blob)
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success(None)
    assert rec.calls[0]["kwargs"] == {"blob": blob}


def test_unregistered_function_is_an_error(app, fns, rec):
    def stranger() -> None:
        pass

    pool = app.pool("bad")
    with pytest.raises(ValueError) as info:
        pool.enqueue_action(stranger)
    _is_workpool_error(info.value)
    with pytest.raises(ValueError):
        pool.enqueue_action("no_such_function")
    with pytest.raises(ValueError):
        pool.enqueue_action("os.system", {"command": "true"})
    with pytest.raises(ValueError):
        pool.enqueue_action_batch("no_such_function", [{}])
    with pytest.raises(ValueError):
        pool.enqueue_action(fns["job"], on_complete=stranger)
    with pytest.raises(ValueError):
        pool.enqueue_action(fns["job"], on_complete="no_such_handler")
    _nothing_stored(app, pool, rec)


def test_a_function_of_another_kind_is_an_error(app, fns, rec):
    pool = app.pool("bad")
    cases = [
        lambda: pool.enqueue_action(fns["mut"]),
        lambda: pool.enqueue_mutation(fns["job"]),
        lambda: pool.enqueue_query(fns["mut"]),
        lambda: pool.enqueue_action(
            fns["job"], on_complete=fns["job"]
        ),  # handler must be a mutation
        lambda: pool.enqueue_action(fns["job"], on_complete=fns["qry"]),
    ]
    for case in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            case()
        _is_workpool_error(info.value)
    _nothing_stored(app, pool, rec)


@pytest.mark.parametrize("value", [-1, -100], ids=["minus1", "minus100"])
def test_negative_max_parallelism_is_a_value_error(app, value):
    with pytest.raises(ValueError) as info:
        app.pool("neg", max_parallelism=value)
    _is_workpool_error(info.value)
    pool = app.pool("neg", max_parallelism=3)
    with pytest.raises(ValueError):
        pool.configure(max_parallelism=value)
    assert pool.stats().max_parallelism == 3


@pytest.mark.parametrize(
    "value", ["3", 2.5, True, None.__class__], ids=["str", "float", "bool", "type"]
)
def test_max_parallelism_of_the_wrong_type(app, value):
    with pytest.raises(TypeError) as info:
        app.pool("wrongtype", max_parallelism=value)
    _is_workpool_error(info.value)
    pool = app.pool("wrongtype", max_parallelism=2)
    with pytest.raises(TypeError):
        pool.configure(max_parallelism=value)
    assert pool.stats().max_parallelism == 2


@pytest.mark.parametrize(
    "retry",
    ["yes", 3, 1.0, {"max_attempts": 3}, [True], 10**5000],
    ids=["str", "int", "float", "dict", "list", "int-too-long-to-print"],
)
def test_wrong_retry_values(app, fns, rec, retry):
    pool = app.pool("bad")
    with pytest.raises(TypeError) as info:
        pool.enqueue_action(fns["job"], retry=retry)
    _is_workpool_error(info.value)
    with pytest.raises(TypeError):
        pool.enqueue_action_batch(fns["job"], [{}], retry=retry)
    _nothing_stored(app, pool, rec)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"max_attempts": 0}, ValueError),
        ({"max_attempts": -3}, ValueError),
        ({"max_attempts": "3"}, TypeError),
        ({"max_attempts": 2.5}, TypeError),
        ({"initial_backoff": -0.1}, ValueError),
        ({"initial_backoff": math.nan}, ValueError),
        ({"initial_backoff": math.inf}, ValueError),
        ({"initial_backoff": "1"}, TypeError),
        ({"base": 0.5}, ValueError),
        ({"base": -2}, ValueError),
        ({"base": math.nan}, ValueError),
        ({"base": None}, TypeError),
    ],
)
def test_retry_behavior_validates_in_its_constructor(kwargs, exc):
    with pytest.raises(exc) as info:
        RetryBehavior(**kwargs)
    _is_workpool_error(info.value)


def test_retry_behavior_defaults():
    r = RetryBehavior()
    assert (r.max_attempts, r.initial_backoff, r.base) == (5, 0.25, 2.0)


def test_wrong_pool_default_retry(app):
    with pytest.raises(TypeError):
        app.pool("p", default_retry={"max_attempts": 3})
    with pytest.raises(TypeError):
        app.pool("p", retry_actions_by_default="yes")


@pytest.mark.parametrize(
    "name",
    [
        "",
        "1starts_with_digit",
        "-dash-first",
        ".dot",
        "has space",
        "slash/inside",
        "x" * 129,
        "emails'; DROP TABLE work; --",
        'pool"; DELETE FROM pools; --',
        "a\nb",
        "trailing_newline\n",
        "semi;colon",
        "star*",
        "quote'",
    ],
    ids=lambda n: repr(n[:20]),
)
def test_bad_pool_names(app, fns, rec, name):
    with pytest.raises(ValueError) as info:
        app.pool(name)
    _is_workpool_error(info.value)
    # the store still works and holds nothing
    ok = app.pool("still_fine")
    wid = ok.enqueue_action(fns["job"])
    run_until_idle(app)
    assert ok.status(wid).result == workpool.Success(None)
    assert [p for p in (getattr(app, "pools", lambda: [])() or []) if p.name == name] == []


@pytest.mark.parametrize("name", [None, 5, b"bytes"], ids=["none", "int", "bytes"])
def test_pool_name_of_the_wrong_type(app, name):
    with pytest.raises(TypeError):
        app.pool(name)


@pytest.mark.parametrize("name", ["a", "_", "Emails", "a.b:c-d_e", "x" * 128, "z9"])
def test_good_pool_names(app, fns, name):
    pool = app.pool(name, max_parallelism=2)
    wid = pool.enqueue_action(fns["job"])
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success(None)
    assert pool.stats().max_parallelism == 2


@pytest.mark.parametrize(
    ("option", "value", "exc"),
    [
        ("log_level", "LOUD", ValueError),
        ("log_level", 20, TypeError),
        ("status_ttl", -1, ValueError),
        ("status_ttl", "1d", TypeError),
    ],
)
def test_bad_pool_options(app, option, value, exc):
    with pytest.raises(exc):
        app.pool("opts", **{option: value})
    pool = app.pool("opts", max_parallelism=1)
    with pytest.raises(exc):
        pool.configure(**{option: value})
    assert pool.stats().max_parallelism == 1


@pytest.mark.parametrize("timeout", [0, -1, math.nan], ids=["zero", "negative", "nan"])
def test_bad_timeouts(app, fns, rec, timeout):
    pool = app.pool("bad")
    with pytest.raises(ValueError):
        pool.enqueue_action(fns["job"], timeout=timeout)
    _nothing_stored(app, pool, rec)


def test_args_that_do_not_fit_the_function_fail_that_work_only(app, fns, rec):
    @app.action(name="strict")
    def strict(a: int) -> int:
        return a

    pool = app.pool("poison", max_parallelism=1)
    bad = pool.enqueue_action(strict, {"unexpected": 1})
    good = pool.enqueue_action_batch(strict, [{"a": i} for i in range(3)])
    run_until_idle(app)
    assert pool.status(bad).result.kind == "failed"
    assert [s.result for s in pool.status_batch(good)] == [workpool.Success(i) for i in range(3)]


def test_a_non_json_return_value_fails_that_work_only(app):
    @app.action(name="returns_object")
    def returns_object() -> object:
        return object()

    @app.action(name="fine")
    def fine() -> int:
        return 1

    pool = app.pool("poison", max_parallelism=1)
    bad = pool.enqueue_action(returns_object)
    good = pool.enqueue_action(fine)
    run_until_idle(app)
    assert pool.status(bad).state == "finished"
    assert pool.status(bad).result.kind == "failed"
    assert pool.status(good).result == workpool.Success(1)


# --- registration ------------------------------------------------------------------------


def test_two_functions_under_one_name_is_an_error(app):
    @app.action(name="dup")
    def first() -> None:
        pass

    def second() -> None:
        pass

    with pytest.raises(ValueError) as info:
        app.action(name="dup")(second)
    _is_workpool_error(info.value)
    with pytest.raises(ValueError):
        app.mutation(name="dup")(second)


def test_default_name_is_the_qualname_and_enqueue_accepts_it(app, rec):
    def local_fn() -> str:  # a function defined inside another one
        rec.add()
        return "local"

    app.action(local_fn)
    pool = app.pool("names")
    wid = pool.enqueue_action(local_fn)
    wid2 = pool.enqueue_action(local_fn.__qualname__)
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success("local")
    assert pool.status(wid2).result == workpool.Success("local")


def test_module_level_function_registers_under_its_qualname(app):
    app.action(module_level_job)
    pool = app.pool("names")
    wid = pool.enqueue_action("module_level_job", {"x": 2})
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success(4)


def module_level_job(x: int) -> int:
    return x * 2


def test_decorators_return_the_function_unchanged(app):
    def plain(x: int) -> int:
        return x + 1

    assert app.action(name="plain")(plain) is plain
    assert plain(1) == 2


def test_worker_runs_only_functions_registered_in_its_app(app, store_url, tmp_path):
    """A row naming an unregistered function (even "os.system") runs nothing."""
    marker = tmp_path / "pwned"
    producer = workpool.App(store_url)
    try:

        @producer.action(name="os.system")
        def fake_system(command: str) -> None:  # only the producer knows this name
            pass

        @producer.action(name="os:system")
        def fake_system2(command: str) -> None:
            pass

        pool = producer.pool("foreign")
        wids = [
            pool.enqueue_action("os.system", {"command": f"touch {marker}"}),
            pool.enqueue_action("os:system", {"command": f"touch {marker}"}),
        ]
    finally:
        producer.close()

    @app.action(name="mine")
    def mine() -> str:
        return "mine"

    own = app.pool("foreign").enqueue_action(mine, run_after=0.05)
    with background_worker(app):
        # One foreign row must not stall the pool: our own work still finishes.
        wait_for(lambda: app.pool("foreign").status(own).state == "finished", timeout=10)
        wait_for(
            lambda: all(app.pool("foreign").status(w).state != "running" for w in wids), timeout=10
        )
    assert not marker.exists()
    for wid in wids:
        status = app.pool("foreign").status(wid)
        assert status.state in ("pending", "finished")
        if status.state == "finished":
            assert status.result.kind == "failed"
            assert "not registered" in status.result.error


def test_bad_store_urls(tmp_path):
    with pytest.raises(ValueError):
        workpool.App("mysql://localhost/db")
    with pytest.raises(TypeError):
        workpool.App(42)  # type: ignore[arg-type]


def test_sqlite_reads_through_a_memory_map_unless_the_url_says_not(tmp_path):
    """SQLite reads the file through a map of MMAP_BYTES (as far as this build of
    SQLite allows), ``?mmap_size=`` sets it, 0 turns it off; a bad size is refused
    before any file is made."""
    plain = sqlite3.connect(tmp_path / "plain.db")
    allowed = plain.execute(f"PRAGMA mmap_size={MMAP_BYTES}").fetchone()[0]
    plain.close()
    for query, expected in [("", allowed), ("?mmap_size=0", 0), ("?mmap_size=65536", 65536)]:
        store = open_store(f"sqlite:///{tmp_path}/m{len(query)}.db{query}")
        try:
            assert store._connection().execute("PRAGMA mmap_size").fetchone()[0] == expected
        finally:
            store.close()
    for bad in ("-1", "1.5", "lots", "1e9", "\u00b2"):
        with pytest.raises(ValueError, match="mmap_size"):
            workpool.App(f"sqlite:///{tmp_path}/bad.db?mmap_size={bad}")
    with pytest.raises(ValueError, match="mmap_size"):
        SqliteStore(str(tmp_path / "bad.db"), mmap_size=-1)
    with pytest.raises(ValueError, match="mmap_size"):
        SqliteStore(str(tmp_path / "bad.db"), mmap_size=True)
    assert not (tmp_path / "bad.db").exists()


def test_bad_postgres_pool_options_are_refused_before_connecting():
    """``pool_size`` and ``prepare_threshold`` in a PostgreSQL URL are checked at
    ``App(...)``, naming the value; the address connects nowhere, so an accepted
    URL shows no connection is tried either."""
    base = "postgresql://nobody@127.0.0.1:1/nodb"
    for bad in ("0", "-1", "1.5", "lots", "\u00b2", " 5"):
        with pytest.raises(ValueError, match=re.escape(f"pool_size={bad!r}")):
            workpool.App(f"{base}?pool_size={quote(bad)}")
    for bad in ("-1", "1.5", "never", "\u00b2", "NULL"):
        with pytest.raises(ValueError, match=re.escape(f"prepare_threshold={bad!r}")):
            workpool.App(f"{base}?prepare_threshold={quote(bad)}")
    for good in (
        "pool_size=1",
        "prepare_threshold=0",
        "prepare_threshold=None",
        "prepare_threshold=9",
    ):
        workpool.App(f"{base}?{good}").close()


def test_app_reads_the_url_from_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "env.db"
    monkeypatch.setenv("WORKPOOL_DATABASE_URL", f"sqlite:///{path}")
    app = workpool.App()
    try:

        @app.action(name="job")
        def job() -> int:
            return 1

        wid = app.pool("env").enqueue_action(job)
        assert app.pool("env").status(wid).state == "pending"
    finally:
        app.close()
    assert path.exists()


def test_app_default_url_is_a_relative_sqlite_file(monkeypatch, tmp_path):
    monkeypatch.delenv("WORKPOOL_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    app = workpool.App()
    try:
        app.pool("default").stats()
    finally:
        app.close()
    assert (tmp_path / "workpool.db").exists()


def test_enqueue_ids_are_unique_uuids(app, fns):
    pool = app.pool("ids")
    wids = pool.enqueue_action_batch(fns["job"], [{}] * 50, run_after=60)
    wids.append(pool.enqueue_action(fns["job"], run_after=60))
    assert len(set(wids)) == 51
    for wid in wids:
        uuid.UUID(wid)
    pool.cancel_all()


def test_work_ids_are_canonical_uuid7_with_74_random_bits_alone_and_counting_up_in_a_batch():
    from workpool.core.ids import new_work_ids

    before = time.time_ns() // 1_000_000
    ids = new_work_ids(20_000)
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 20_000
    parsed = [uuid.UUID(i) for i in ids]
    assert [str(u) for u in parsed] == ids  # canonical: lowercase, hyphens in place
    assert {u.version for u in parsed} == {7}
    assert {u.variant for u in parsed} == {uuid.RFC_4122}
    assert all(before <= u.int >> 80 <= after for u in parsed)  # the 48-bit milliseconds
    # A batch shares everything above its last 48 bits, which count up by one.
    assert len({u.int >> 48 for u in parsed}) == 1
    low = [u.int & ((1 << 48) - 1) for u in parsed]
    assert low == list(range(low[0], low[0] + 20_000))
    # Across batches every random position varies: the 12 bits after the version,
    # the 2 variant-digit bits, the 12 bits after them and the 48 of the start.
    singles = [new_work_ids(1)[0] for _ in range(4_000)]
    assert all(str(uuid.UUID(i)) == i and uuid.UUID(i).version == 7 for i in singles)
    starts = [uuid.UUID(i).int for i in singles]
    assert len(set(starts)) == 4_000
    fields = ((64, 0xFFF), (60, 3), (48, 0xFFF), (0, (1 << 48) - 1))
    for shift, mask in fields:
        seen = [v >> shift & mask for v in starts]
        width = mask.bit_length()
        assert all(
            any(v >> bit & 1 for v in seen) and not all(v >> bit & 1 for v in seen)
            for bit in range(width)
        ), (shift, mask)
    assert new_work_ids(0) == []


@pytest.mark.parametrize("highest", [False, True])
def test_a_batch_counts_within_its_last_48_bits_from_any_random_start(monkeypatch, highest):
    import os

    from workpool.core.ids import new_work_ids

    count = 1_000
    # All ones: a start taken modulo 2**48 alone would be 2**48 - 1, and counting
    # would carry into the head. Else the random bits of the highest start allowed.
    # Either way the head's 26 random bits are all ones, which a carry would change.
    rand = ((1 << 48) - count) << 26 | (1 << 26) - 1 if highest else (1 << 80) - 1
    monkeypatch.setattr(os, "urandom", lambda n: rand.to_bytes(n))
    ids = new_work_ids(count)
    parsed = [uuid.UUID(i) for i in ids]
    assert {u.version for u in parsed} == {7} and {u.variant for u in parsed} == {uuid.RFC_4122}
    assert {u.int >> 48 & (1 << 32) - 1 for u in parsed} == {0x7FFFBFFF}
    low = [u.int & ((1 << 48) - 1) for u in parsed]
    assert low == list(range(low[0], low[0] + count))
    assert ids[-1].endswith("-ffffffffffff") == highest


def test_errors_share_one_root():
    assert issubclass(workpool.WorkpoolError, Exception)
    assert issubclass(workpool.NonRetryableError, Exception)


# --- property: any string is either a valid pool name or a clean ValueError -----------------


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAME_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:\-]{0,127}")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.one_of(
        st.text(max_size=140),
        st.from_regex(NAME_RULE, fullmatch=True),
        st.text(alphabet="abc_.:-'\";()% \\/*=\n", max_size=30),
    )
)
def test_pool_names_property(app, name):
    if NAME_RULE.fullmatch(name):
        pool = app.pool(name, max_parallelism=1)
        assert pool.stats().max_parallelism == 1  # stored and read back under that name
    else:
        with pytest.raises(ValueError):
            app.pool(name, max_parallelism=1)


def test_context_is_checked_even_without_on_complete(app, fns, rec):
    """Bad input is an error at the call site, whether or not a handler will read it."""
    pool = app.pool("bad")
    with pytest.raises(ValueError):
        pool.enqueue_action(fns["job"], {}, context="y" * (LIMIT + 1))
    with pytest.raises(TypeError):
        pool.enqueue_action(fns["job"], {}, context={"o": NotJson()})
    _nothing_stored(app, pool, rec)


def test_configure_rejects_unknown_options(app):
    pool = app.pool("cfg", max_parallelism=2)
    with pytest.raises(TypeError):
        pool.configure(max_paralelism=5)  # typo
    assert pool.stats().max_parallelism == 2


def test_empty_batch_enqueues_nothing(app, fns, rec):
    pool = app.pool("empty")
    assert pool.enqueue_action_batch(fns["job"], []) == []
    assert pool.enqueue_mutation_batch(fns["mut"], []) == []
    _nothing_stored(app, pool, rec)


# --- property: payloads encode exactly as json.dumps, and fail with its reasons -----------

from hypothesis import strategies as st  # noqa: E402

from workpool.core.validation import encode_json  # noqa: E402

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.builds(object),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers() | st.booleans(), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(JSONISH)
def test_encode_json_writes_what_json_dumps_writes_or_its_error(value):
    try:
        expected = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        with pytest.raises(workpool.InvalidTypeError) as info:
            encode_json(value, "args")
        assert str(exc) in str(info.value)
        return
    assert encode_json(value, "args") == expected


def test_encode_json_names_a_circular_payload():
    loop: list[object] = []
    loop.append({"again": loop})
    with pytest.raises(workpool.InvalidTypeError, match="args must be JSON-serialisable: Circ"):
        encode_json(loop, "args")
