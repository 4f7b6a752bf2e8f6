"""Bad input everywhere (PRODUCT.md section 8), as properties, on both stores.

Every public entry point is called with generated values -- wrong types, sizes,
names, times, retry settings, SQL-looking strings -- and must either accept the
call or raise a clear error: ``ValueError`` for a bad value, ``TypeError`` for a
bad type, both subclasses of ``workpool.WorkpoolError``. Any other exception
(a driver error, ``OverflowError``, ``RecursionError``...) fails the test. A
rejected call must leave the store exactly as it was (every row of every
table, and the list of tables).

The oracles below are written from the documented rules, independently of the
library's validators. Each generated parameter carries the set of outcomes it
allows: ``OK``, ``VE`` (ValueError) or ``TE`` (TypeError); a call may end in
``OK`` only if every parameter allows it, and in an error only if some
parameter allows that error.

The second half seeds rows directly in the ``work`` table (unregistered
functions, corrupt JSON) and runs a real worker over them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import workpool
from conftest import pg_schema_of, ph
from workpool import RetryBehavior

pytestmark = pytest.mark.timeout(180)

OK, VE, TE = "ok", ValueError, TypeError
Allowed = frozenset[Any]

NOW = 1_700_000_000.0  # the app clock in these tests
MAX_PAYLOAD = 1_000_000
FOUR_YEARS = 4 * 365 * 86_400.0
ONE_DAY = 86_400.0
MAX_ATTEMPTS = 10_000  # documented caps (docs/guide.md): durations, attempts, threads
MAX_CONCURRENCY = 10_000
NAME_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:\-]{0,127}")
SCHEMA_RULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
LOG_LEVELS = {"DEBUG", "TRACE", "INFO", "REPORT", "WARN", "WARNING", "ERROR"}

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SQL_STRINGS = [
    "x'; DROP TABLE work; --",
    "'; DELETE FROM pools; --",
    '"; DROP SCHEMA public CASCADE; --',
    "Robert'); DROP TABLE finished;--",
    "1 OR 1=1",
    "work",
    'pools" --',
    "%s",
    "?",
    "$1",
    "%(x)s",
    "'",
    '"',
    "\\",
    "`",
    "",
    " ",
    "\n",
    "a\n",
    "a\nb",
    "\x00",
    "a\x00b",
    "-x",
    ".x",
    "1abc",
    "a b",
    "a/b",
    "../../etc/passwd",
    "a" * 129,
    "a" * 128,
    "ünïcödé",
    "🙂",
    "os.system",
    "builtins.eval",
    "__import__",
]
TEXT = st.one_of(st.sampled_from(SQL_STRINGS), st.text(max_size=40))


@dataclasses.dataclass
class CallableObject:
    """A callable dataclass instance: callable, but unhashable (``__eq__`` without hash)."""

    x: int = 0

    def __call__(self) -> None:
        return None


def _unregistered(**kwargs: Any) -> None:
    return None


UNSERIALISABLE = [
    {1, 2},
    b"bytes",
    object(),
    1j,
    float("nan"),
    float("inf"),
    -float("inf"),
    Decimal("1.5"),
    datetime(2024, 1, 1),
    _unregistered,
]


def _many_digits() -> int:
    """An int beyond Python's int-to-str limit (its repr raises ValueError)."""
    return 10**5000


MANY_DIGITS = st.builds(_many_digits)  # not sampled_from: hypothesis would repr it
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(),
    TEXT,
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(UNSERIALISABLE),
    MANY_DIGITS,
    st.sampled_from([Fraction(1, 3), Decimal("2"), 2 + 0j, CallableObject(), range(3)]),
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
TIMEZONES = st.sampled_from(
    [UTC, timezone(timedelta(hours=5)), timezone(timedelta(hours=-11, minutes=-30))]
)


def show(value: object) -> str:
    """repr for messages; never raises (an int of 5,000 digits has no repr)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__} {value.bit_length() if isinstance(value, int) else ''}>"
    return text if len(text) <= 200 else text[:200] + "..."


def allowed(*sets: Allowed) -> Allowed:
    """The outcomes a call may end in, given what each of its parameters allows."""
    result: set[Any] = set()
    if all(OK in s for s in sets):
        result.add(OK)
    for s in sets:
        result |= s - {OK}
    return frozenset(result)


def outcome(call: Callable[[], Any]) -> tuple[Any, Any]:
    """(OK, value) or (VE/TE, error); anything that is not a WorkpoolError propagates."""
    try:
        return OK, call()
    except workpool.WorkpoolError as exc:
        if isinstance(exc, ValueError) and not isinstance(exc, TypeError):
            return VE, exc
        if isinstance(exc, TypeError) and not isinstance(exc, ValueError):
            return TE, exc
        raise AssertionError(f"{exc!r} is neither only a ValueError nor only a TypeError") from exc


def check(call: Callable[[], Any], expected: Allowed, what: str) -> tuple[Any, Any]:
    kind, value = outcome(call)
    assert kind in expected, (
        f"{what}: got {kind if kind == OK else type(value).__name__}"
        f" ({show(value)}), expected one of {sorted(map(str, expected))}"
    )
    return kind, value


# --- oracles ------------------------------------------------------------------------------


def seconds_oracle(
    value: object,
    *,
    minimum: float | None = None,
    positive: bool = False,
    maximum: float | None = None,
) -> Allowed:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return frozenset({TE})
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float: a bad value, not a bad type
        return frozenset({VE})
    if not math.isfinite(number):
        return frozenset({VE})
    if minimum is not None and number < minimum:
        return frozenset({VE})
    if positive and number <= 0:
        return frozenset({VE})
    if maximum is not None and number > maximum:  # a documented cap: a clear ValueError
        return frozenset({VE})
    return frozenset({OK})


def int_oracle(value: object, low: int, high: int | None = None) -> Allowed:
    if isinstance(value, bool) or not isinstance(value, int):
        return frozenset({TE})
    if value < low or (high is not None and value > high):
        return frozenset({VE})
    return frozenset({OK})


def name_oracle(value: object) -> Allowed:
    if not isinstance(value, str):
        return frozenset({TE})
    return frozenset({OK if NAME_RULE.fullmatch(value) else VE})


def json_oracle(value: object) -> Allowed:
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return frozenset({TE, VE})
    return frozenset({OK if len(text.encode()) <= MAX_PAYLOAD else VE})


def args_oracle(value: object) -> Allowed:
    if value is None:
        return frozenset({OK})
    if not isinstance(value, dict):
        return frozenset({TE})
    for key in value:
        if not isinstance(key, str):
            return frozenset({VE, TE})
        if not key.isidentifier():
            return frozenset({VE})
    return json_oracle(value)


def max_parallelism_oracle(value: object) -> Allowed:
    if isinstance(value, bool) or not isinstance(value, int):
        return frozenset({TE})
    if value < 0:
        return frozenset({VE})
    # "no small hard cap": up to 1,000 must be accepted; a cap far above is fine.
    return frozenset({OK}) if value <= 1000 else frozenset({OK, VE})


def log_level_oracle(value: object) -> Allowed:
    if not isinstance(value, str):
        return frozenset({TE})
    return frozenset({OK if value.upper() in LOG_LEVELS else VE})


def retry_option_oracle(value: object) -> Allowed:
    if value is None or value is True or value is False or isinstance(value, RetryBehavior):
        return frozenset({OK})
    return frozenset({TE})


def run_at_oracle(value: object) -> Allowed:
    if value is None:
        return frozenset({OK})
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return frozenset({VE})
        at = value.timestamp()
    else:
        number = seconds_oracle(value)
        if number != {OK}:
            return number
        at = float(value)  # type: ignore[arg-type]
    return frozenset({VE if at > NOW + FOUR_YEARS else OK})


def run_after_oracle(value: object) -> Allowed:
    if value is None:
        return frozenset({OK})
    number = seconds_oracle(value)
    if number != {OK}:
        return number
    return frozenset({VE if float(value) > FOUR_YEARS else OK})  # type: ignore[arg-type]


def retry_behavior_oracle(max_attempts: object, initial_backoff: object, base: object) -> Allowed:
    return allowed(
        int_oracle(max_attempts, 1, MAX_ATTEMPTS),
        seconds_oracle(initial_backoff, minimum=0.0, maximum=ONE_DAY),
        seconds_oracle(base, minimum=1.0),
    )


def tagged(strategy: st.SearchStrategy[Any], oracle: Callable[[Any], Allowed]) -> Any:
    return strategy.map(lambda value: (value, oracle(value)))


def optional(oracle: Callable[[Any], Allowed]) -> Callable[[Any], Allowed]:
    """An option whose None means "not given"."""
    return lambda value: frozenset({OK}) if value is None else oracle(value)


SECONDS_VALUES = st.one_of(
    JUNK,
    st.floats(min_value=-1e6, max_value=1e6),
    st.sampled_from([0, 0.0, -0.0, 0.1, 1, 1e300, 1e308, 10**400, -(10**400), 2**63, 86_400]),
)
RETRY_BEHAVIORS = st.builds(
    RetryBehavior,
    max_attempts=st.integers(1, 10),
    initial_backoff=st.floats(0, 10),
    base=st.floats(1, 10),
)


# --- store snapshots ----------------------------------------------------------------------


def snapshot(app: workpool.App, url: str) -> tuple[Any, ...]:
    """Every table's name and every row of the store: what 'nothing changed' compares."""
    schema = pg_schema_of(url)

    def body(tx: workpool.Tx) -> tuple[Any, ...]:
        if schema:
            names = [
                r[0]
                for r in tx.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s"
                    " ORDER BY table_name",
                    (schema,),
                ).fetchall()
            ]
            prefix = f'"{schema}".'
        else:
            names = [
                r[0]
                for r in tx.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
                ).fetchall()
            ]
            prefix = ""
        rows = {
            name: sorted(repr(tuple(r)) for r in tx.execute(f"SELECT * FROM {prefix}{name}"))
            for name in names
        }
        return tuple(names), rows

    return app.run(body, readonly=True)


@pytest.fixture
def fns(app: workpool.App) -> dict[str, Any]:
    app.clock = lambda: NOW

    @app.action(name="job")
    def job(**kwargs: Any) -> str:
        return "done"

    @app.mutation(name="mut")
    def mut(tx: workpool.Tx, **kwargs: Any) -> None:
        return None

    @app.query(name="qry")
    def qry(tx: workpool.Tx, **kwargs: Any) -> None:
        return None

    @app.mutation(name="on_done")
    def on_done(tx: workpool.Tx, work_id: str, context: Any, result: workpool.Result) -> None:
        return None

    app.pool("p").stats()  # the schema exists from here on
    return {"action": job, "mutation": mut, "query": qry, "on_done": on_done}


# --- App(url) -----------------------------------------------------------------------------

PG_BASE = "postgresql://nobody@127.0.0.1:1/nodb"


def _url_oracle(url: object) -> Allowed:
    if not isinstance(url, str):
        return frozenset({TE})
    return frozenset({OK, VE})


def _schema_in_url_oracle(url: str) -> Allowed:
    """The schema as the URL parser reads it: absent or empty means the default."""
    schema = dict(parse_qsl(urlsplit(url).query)).get("schema")
    if not schema:
        return frozenset({OK, VE})  # other parameters may still be refused
    return frozenset({OK if SCHEMA_RULE.fullmatch(schema) else VE})


def _mmap_in_url_oracle(url: str) -> Allowed:
    """A SQLite URL's memory map size must be a whole number of bytes (absent: the
    default); other parameters may still be refused."""
    size = dict(parse_qsl(urlsplit(url).query)).get("mmap_size")
    if size is None or (size.isascii() and size.isdigit()):
        return frozenset({OK, VE})
    return frozenset({VE})


def _pg_options_oracle(url: str) -> Allowed:
    """A PostgreSQL URL's pool_size must be a whole number from 1, its
    prepare_threshold one from 0 or "none" (absent: the defaults); other parameters
    may still be refused."""
    query = dict(parse_qsl(urlsplit(url).query))
    size, threshold = query.get("pool_size"), query.get("prepare_threshold")
    if size is not None and not (size.isascii() and size.isdigit() and int(size) > 0):
        return frozenset({VE})
    if threshold is not None and not (
        threshold.lower() == "none" or (threshold.isascii() and threshold.isdigit())
    ):
        return frozenset({VE})
    return frozenset({OK, VE})


URLS = st.one_of(
    tagged(JUNK.filter(lambda v: v is not None), _url_oracle),
    tagged(TEXT, _url_oracle),
    tagged(
        st.sampled_from(["sqlite://", "sqlite:///", "mysql://x/y", "sqlite:x.db"]), lambda u: {VE}
    ),
    # a schema in the URL must be a plain identifier
    TEXT.map(lambda s: (f"{PG_BASE}?schema={s}", _schema_in_url_oracle(f"{PG_BASE}?schema={s}"))),
    TEXT.map(
        lambda s: (f"{PG_BASE}?pool_size={s}", _pg_options_oracle(f"{PG_BASE}?pool_size={s}"))
    ),
    TEXT.map(
        lambda s: (
            f"{PG_BASE}?prepare_threshold={s}",
            _pg_options_oracle(f"{PG_BASE}?prepare_threshold={s}"),
        )
    ),
    TEXT.map(lambda s: (f"sqlite:////tmp/never-created.db?synchronous={s}", frozenset({OK, VE}))),
    TEXT.map(
        lambda s: (
            f"sqlite:////tmp/never-created.db?mmap_size={s}",
            _mmap_in_url_oracle(f"sqlite:////tmp/never-created.db?mmap_size={s}"),
        )
    ),
)


@FUZZ
@given(url=URLS)
@example(url=(f"{PG_BASE}?schema=a%0A", frozenset({VE})))
@example(url=(f"{PG_BASE}?schema=x';DROP", frozenset({VE})))
@example(url=(f"{PG_BASE}?pool_size=-1", frozenset({VE})))
@example(url=(f"{PG_BASE}?prepare_threshold=none", frozenset({OK})))
def test_app_urls(url: tuple[Any, Allowed]) -> None:
    """App(url) accepts or refuses cleanly; it connects to nothing doing so."""
    value, expected = url
    kind, app = check(lambda: workpool.App(value), expected, f"App({show(value)})")
    if kind == OK:
        app.close()


@FUZZ
@given(
    schema=st.one_of(
        TEXT, JUNK.filter(lambda v: v is not None), st.from_regex(SCHEMA_RULE, fullmatch=True)
    ),
    postgres=st.booleans(),
)
def test_app_schema_keyword(schema: Any, postgres: bool) -> None:
    """The schema keyword is the one identifier interpolated into SQL: checked strictly."""
    url = PG_BASE if postgres else "sqlite:////tmp/never-created.db"
    if not isinstance(schema, str):
        expected = frozenset({TE})
    elif not NAME_RULE.fullmatch(schema):
        expected = frozenset({VE})
    elif postgres:
        expected = frozenset({OK if SCHEMA_RULE.fullmatch(schema) else VE})
    else:
        expected = frozenset({OK})
    kind, app = check(lambda: workpool.App(url, schema=schema), expected, f"schema={show(schema)}")
    if kind == OK:
        app.close()


# --- app.pool(name, **options) ------------------------------------------------------------

POOL_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "max_parallelism": tagged(
            st.one_of(JUNK, st.integers(-5, 2000), st.sampled_from([10**7, 2**31, 2**63])),
            optional(max_parallelism_oracle),
        ),
        "retry_actions_by_default": tagged(
            st.one_of(JUNK, st.booleans()),
            optional(lambda v: frozenset({OK if isinstance(v, bool) else TE})),
        ),
        "default_retry": tagged(
            st.one_of(JUNK, RETRY_BEHAVIORS),
            optional(lambda v: frozenset({OK if isinstance(v, RetryBehavior) else TE})),
        ),
        "log_level": tagged(
            st.one_of(JUNK, st.sampled_from(sorted(LOG_LEVELS | {"info", "Warn", "verbose"}))),
            optional(log_level_oracle),
        ),
        "status_ttl": tagged(
            SECONDS_VALUES,
            optional(lambda v: seconds_oracle(v, minimum=0.0, maximum=FOUR_YEARS)),
        ),
    },
)


@FUZZ
@given(
    name=tagged(st.one_of(TEXT, JUNK, st.from_regex(NAME_RULE, fullmatch=True)), name_oracle),
    options=POOL_OPTIONS,
)
@example(name=("x'; DROP TABLE work; --", frozenset({VE})), options={})
@example(name=("ok\n", frozenset({VE})), options={})
def test_app_pool(
    app: workpool.App, store_url: str, fns: Any, name: tuple[Any, Allowed], options: dict[str, Any]
) -> None:
    before = snapshot(app, store_url)
    names_before = [p.name for p in app.pools()]
    kwargs = {key: value for key, (value, _) in options.items()}
    expected = allowed(name[1], *(oracle for _, oracle in options.values()))
    kind, pool = check(lambda: app.pool(name[0], **kwargs), expected, f"app.pool({show(name[0])})")
    if kind != OK:
        assert [p.name for p in app.pools()] == names_before
    else:
        # Declaring a pool writes nothing; reading its (would-be) config is a read too.
        stats = pool.stats()
        if kwargs.get("max_parallelism") is not None:
            assert stats.max_parallelism == kwargs["max_parallelism"]
    assert snapshot(app, store_url) == before


# --- enqueue --------------------------------------------------------------------------------


def fn_choices(kind: str, fns: dict[str, Any]) -> list[tuple[Any, Allowed]]:
    other = "mutation" if kind != "mutation" else "action"
    return [
        (fns[kind], frozenset({OK})),
        ({"action": "job", "mutation": "mut", "query": "qry"}[kind], frozenset({OK})),
        (fns[other], frozenset({VE})),  # registered as another kind
        ({"action": "job", "mutation": "mut", "query": "qry"}[other], frozenset({VE})),
        (_unregistered, frozenset({VE})),
        ("x'; DROP TABLE work; --", frozenset({VE})),
        ("os.system", frozenset({VE})),
        (None, frozenset({TE})),
        (42, frozenset({TE})),
        (b"job", frozenset({TE})),
    ]


def handler_choices(fns: dict[str, Any]) -> list[tuple[Any, Allowed]]:
    return [
        (None, frozenset({OK})),
        (fns["on_done"], frozenset({OK})),
        ("on_done", frozenset({OK})),
        (fns["action"], frozenset({VE})),
        ("qry", frozenset({VE})),
        ("nope", frozenset({VE})),
        (_unregistered, frozenset({VE})),
        (3.5, frozenset({TE})),
    ]


ARGS = st.one_of(
    tagged(st.none(), args_oracle),
    tagged(
        st.dictionaries(
            st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), JSON_VALUES, max_size=4
        ),
        args_oracle,
    ),
    tagged(st.dictionaries(TEXT, st.integers(), min_size=1, max_size=2), args_oracle),
    tagged(
        st.dictionaries(
            st.integers() | st.tuples(st.integers()), st.integers(), min_size=1, max_size=2
        ),
        args_oracle,
    ),
    tagged(
        st.one_of(st.sampled_from(UNSERIALISABLE), MANY_DIGITS).map(lambda v: {"x": v}), args_oracle
    ),
    tagged(JUNK, args_oracle),
    tagged(st.just({"x": "a" * (MAX_PAYLOAD + 1)}), args_oracle),
)
CONTEXTS = st.one_of(
    tagged(JSON_VALUES, json_oracle),
    tagged(st.sampled_from(UNSERIALISABLE), json_oracle),
    tagged(st.just(["a" * MAX_PAYLOAD]), json_oracle),
)
RUN_ATS = st.one_of(
    st.none(),
    SECONDS_VALUES,
    st.floats(NOW - 10 * FOUR_YEARS, NOW + 2 * FOUR_YEARS),
    st.datetimes(timezones=TIMEZONES),
    st.datetimes(),  # naive
)


def batch_oracle(value: object) -> Allowed:
    if isinstance(value, str | bytes | dict) or not isinstance(value, list | tuple | range):
        return frozenset({TE})
    return allowed(*(args_oracle(a) for a in value))


@st.composite
def enqueue_calls(
    draw: st.DrawFn, fns: dict[str, Any]
) -> tuple[str, Any, Any, dict[str, Any], Allowed]:
    kind = draw(st.sampled_from(["action", "mutation", "query"]))
    batch = draw(st.booleans())
    fn, fn_ok = draw(st.sampled_from(fn_choices(kind, fns)))
    oracles = [fn_ok]
    if batch:
        shape = draw(st.sampled_from(["list", "tuple", "junk"]))
        if shape == "junk":
            args, ok = draw(
                tagged(st.one_of(JUNK, st.sampled_from(["job", {"a": 1}])), batch_oracle)
            )
            oracles.append(ok)
        else:
            items = draw(st.lists(ARGS, max_size=3))
            args = [a for a, _ in items]
            if shape == "tuple":
                args = tuple(args)
            oracles += [o for _, o in items]
    else:
        args, ok = draw(ARGS)
        oracles.append(ok)
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        handler, ok = draw(st.sampled_from(handler_choices(fns)))
        kwargs["on_complete"] = handler
        oracles.append(ok)
    if draw(st.booleans()):
        kwargs["context"], ok = draw(CONTEXTS)
        oracles.append(ok)
    if kind == "action" and draw(st.booleans()):
        kwargs["retry"], ok = draw(
            tagged(st.one_of(JUNK, st.booleans(), RETRY_BEHAVIORS), retry_option_oracle)
        )
        oracles.append(ok)
    if kind == "action" and draw(st.booleans()):
        kwargs["timeout"], ok = draw(
            tagged(
                SECONDS_VALUES,
                lambda v: (
                    frozenset({OK})
                    if v is None
                    else seconds_oracle(v, positive=True, maximum=FOUR_YEARS)
                ),
            )
        )
        oracles.append(ok)
    when = draw(st.sampled_from(["none", "run_at", "run_after", "both"]))
    if when in ("run_at", "both"):
        kwargs["run_at"] = draw(RUN_ATS)
        oracles.append(run_at_oracle(kwargs["run_at"]))
    if when in ("run_after", "both"):
        kwargs["run_after"] = draw(SECONDS_VALUES)
        oracles.append(run_after_oracle(kwargs["run_after"]))
    if when == "both" and kwargs["run_at"] is not None and kwargs["run_after"] is not None:
        oracles.append(frozenset({VE}))
    if draw(st.integers(0, 9)) == 0:
        kwargs["tx"] = draw(JUNK)
        oracles.append(frozenset({OK}) if kwargs["tx"] is None else frozenset({TE}))
    method = f"enqueue_{kind}" + ("_batch" if batch else "")
    return method, fn, args, kwargs, allowed(*oracles)


@FUZZ
@given(data=st.data())
def test_enqueue(app: workpool.App, store_url: str, fns: dict[str, Any], data: Any) -> None:
    """Every enqueue variant, every parameter: accepted, or refused with nothing stored."""
    pool = app.pool("p")
    method, fn, args, kwargs, expected = data.draw(enqueue_calls(fns), label="call")
    before = snapshot(app, store_url)
    kind, ids = check(
        lambda: getattr(pool, method)(fn, args, **kwargs),
        expected,
        f"{method}({show(fn)}, {show(args)}, {show(kwargs)})",
    )
    if kind != OK:
        assert snapshot(app, store_url) == before, f"{method} was refused but changed the store"
        return
    ids = ids if isinstance(ids, list) else [ids]
    assert len(ids) == (len(args) if method.endswith("_batch") else 1)
    assert all(status.state == "pending" for status in pool.status_batch(ids))


def test_an_unhashable_callable_is_refused_as_unregistered(
    app: workpool.App, store_url: str, fns: dict[str, Any]
) -> None:
    """A callable object that is not hashable (a dataclass with __call__) is simply not a
    registered function: NotRegisteredError, not a bare 'unhashable type' TypeError."""
    pool = app.pool("p")
    with pytest.raises(workpool.NotRegisteredError):
        pool.enqueue_action(CallableObject())
    with pytest.raises(workpool.NotRegisteredError):
        pool.enqueue_action("job", on_complete=CallableObject())


# --- status, status_batch, cancel, inspect ------------------------------------------------

IDS = st.one_of(TEXT, st.uuids().map(str), JUNK)


def id_oracle(value: object) -> Allowed:
    return frozenset({OK if isinstance(value, str) else TE})


def ids_oracle(value: object) -> Allowed:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        return frozenset({TE})
    return allowed(*(id_oracle(v) for v in value))


@FUZZ
@given(
    one=IDS,
    many=st.one_of(st.lists(IDS, max_size=4), st.lists(TEXT, max_size=4).map(tuple), JUNK),
)
@example(one="a\x00b", many=["ok", "a\x00b"])
@example(one="x'; DROP TABLE work; --", many=[str(uuid.uuid4()) for _ in range(3)])
@example(one=_many_digits(), many=[_many_digits()])  # a bad type, whose repr() raises
def test_status_cancel_and_inspect_ids(
    app: workpool.App, store_url: str, fns: dict[str, Any], one: Any, many: Any
) -> None:
    pool = app.pool("p")
    before = snapshot(app, store_url)
    kind, status = check(lambda: pool.status(one), id_oracle(one), f"status({show(one)})")
    if kind == OK:
        assert status == workpool.Finished(None)
    kind, canceled = check(lambda: pool.cancel(one), id_oracle(one), f"cancel({show(one)})")
    if kind == OK:
        assert canceled is False
    kind, info = check(lambda: app.inspect(one), id_oracle(one), f"inspect({show(one)})")
    if kind == OK:
        assert info is None
    kind, statuses = check(
        lambda: pool.status_batch(many), ids_oracle(many), f"batch({show(many)})"
    )
    if kind == OK:
        assert statuses == [workpool.Finished(None)] * len(many)
    assert snapshot(app, store_url) == before


def test_many_unknown_ids_in_one_batch(app: workpool.App, fns: dict[str, Any]) -> None:
    """More ids than one IN list holds: chunked, all answered, in order."""
    pool = app.pool("p")
    wid = pool.enqueue_action("job", run_after=60)
    ids = [str(uuid.uuid4()) for _ in range(1200)]
    ids.insert(700, wid)
    statuses = pool.status_batch(ids)
    assert len(statuses) == 1201
    assert statuses[700].state == "pending"
    assert all(s == workpool.Finished(None) for i, s in enumerate(statuses) if i != 700)


# --- cancel_all, configure, stats / history / recent_failures ----------------------------


def before_oracle(value: object) -> Allowed:
    if value is None:
        return frozenset({OK})
    if isinstance(value, datetime):
        return frozenset({OK if value.tzinfo is not None else VE})
    return seconds_oracle(value, minimum=0.0)


@FUZZ
@given(
    before=st.one_of(SECONDS_VALUES, st.datetimes(timezones=TIMEZONES), st.datetimes()),
    limit=st.one_of(JUNK, st.integers(-3, 5)),
)
@example(before=None, limit="5")
@example(before=10**400, limit=None)
def test_cancel_all_arguments(
    app: workpool.App, store_url: str, fns: dict[str, Any], before: Any, limit: Any
) -> None:
    # Work in another pool must never be touched by this pool's cancel_all.
    other = app.pool("other")
    if not other.stats().scheduled:
        other.enqueue_action("job", run_after=3600)
    pool = app.pool("p")
    snap = snapshot(app, store_url)
    limit_ok = frozenset({OK}) if limit is None else int_oracle(limit, 1)
    kind, count = check(
        lambda: pool.cancel_all(before=before, limit=limit),
        allowed(before_oracle(before), limit_ok),
        f"cancel_all(before={show(before)}, limit={show(limit)})",
    )
    if kind == OK:
        assert count == 0
    assert snapshot(app, store_url) == snap


CONFIGURE_OPTIONS = st.one_of(
    POOL_OPTIONS,
    st.dictionaries(
        st.sampled_from(["max_paralelism", "name", "pool", "x'; DROP TABLE pools; --"]),
        st.integers(0, 3).map(lambda v: (v, frozenset({TE}))),
        min_size=1,
        max_size=1,
    ),
)


@FUZZ
@given(options=CONFIGURE_OPTIONS)
def test_configure(
    app: workpool.App, store_url: str, fns: dict[str, Any], options: dict[str, Any]
) -> None:
    pool = app.pool("p")
    before = snapshot(app, store_url)
    kwargs = {key: value for key, (value, _) in options.items()}
    expected = allowed(*(oracle for _, oracle in options.values()))
    kind, config = check(lambda: pool.configure(**kwargs), expected, f"configure({show(kwargs)})")
    if kind != OK:
        assert snapshot(app, store_url) == before
        return
    stats = pool.stats()
    for key, value in kwargs.items():
        if value is None:
            continue
        if key == "max_parallelism":
            assert stats.max_parallelism == value == config.max_parallelism
        elif key == "log_level":
            assert config.log_level in LOG_LEVELS
        else:
            assert getattr(config, key) == value


@FUZZ
@given(
    window=SECONDS_VALUES,
    minutes=st.one_of(JUNK, st.integers(-2, 1500)),
    limit=st.one_of(JUNK, st.integers(-2, 1200)),
)
@example(window=1e300, minutes=60, limit=20)
@example(window=60.0, minutes="5", limit=20)
@example(window=60.0, minutes=60, limit="5")
def test_read_only_pool_calls(
    app: workpool.App, store_url: str, fns: dict[str, Any], window: Any, minutes: Any, limit: Any
) -> None:
    pool = app.pool("p")
    before = snapshot(app, store_url)
    check(
        lambda: pool.stats(window),
        seconds_oracle(window, minimum=1.0, maximum=FOUR_YEARS),
        f"stats({show(window)})",
    )
    check(lambda: pool.history(minutes), int_oracle(minutes, 1, 1440), f"history({show(minutes)})")
    check(
        lambda: pool.recent_failures(limit),
        int_oracle(limit, 1, 1000),
        f"recent_failures({show(limit)})",
    )
    assert snapshot(app, store_url) == before


# --- RetryBehavior ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    max_attempts=st.one_of(JUNK, st.integers(-3, 20)),
    initial_backoff=st.one_of(SECONDS_VALUES, st.floats(0, 100)),
    base=st.one_of(SECONDS_VALUES, st.floats(0, 100)),
)
def test_retry_behavior_constructor(max_attempts: Any, initial_backoff: Any, base: Any) -> None:
    expected = retry_behavior_oracle(max_attempts, initial_backoff, base)
    check(
        lambda: RetryBehavior(max_attempts, initial_backoff, base),
        expected,
        f"RetryBehavior({show(max_attempts)}, {show(initial_backoff)}, {show(base)})",
    )


@settings(max_examples=200, deadline=None)
@given(
    retry=st.builds(
        RetryBehavior,
        max_attempts=st.integers(1, 40),
        initial_backoff=st.one_of(st.floats(0, ONE_DAY), st.sampled_from([0.0, 0.25, ONE_DAY])),
        base=st.one_of(st.floats(1, 1e308), st.sampled_from([1.0, 2.0, 10.0, 1e300])),
    ),
    rand=st.sampled_from([0.0, 0.5, 0.999999]),
)
@example(retry=RetryBehavior(max_attempts=5, initial_backoff=0.0, base=1e300), rand=0.5)
def test_an_accepted_retry_behavior_has_a_finite_backoff(retry: RetryBehavior, rand: float) -> None:
    """Every retry an accepted policy allows gets a wait (capped at a day, with jitter)."""
    for n in range(1, retry.max_attempts):
        wait = retry.delay(n, rand)
        assert math.isfinite(wait) and 0.0 <= wait <= 1.5 * 86_400.0, (n, wait)


@FUZZ
@given(max_attempts=st.one_of(st.integers(1, 100), st.sampled_from([2**31 - 1, 2**31, 2**63])))
@example(max_attempts=2**31)
@example(max_attempts=2**63)
def test_an_accepted_pool_retry_policy_is_stored_or_refused_cleanly(
    app: workpool.App, store_url: str, fns: dict[str, Any], max_attempts: int
) -> None:
    """A RetryBehavior the constructor accepted either becomes the pool default or is a
    clear ValueError at the call site -- never a driver overflow."""
    if max_attempts > MAX_ATTEMPTS:  # refused by the constructor itself, clearly
        with pytest.raises(ValueError, match="max_attempts"):
            RetryBehavior(max_attempts=max_attempts)
        return
    retry = RetryBehavior(max_attempts=max_attempts)
    before = snapshot(app, store_url)
    name = f"r{max_attempts}"
    kind, _ = check(
        lambda: app.pool(name, default_retry=retry).configure(),
        frozenset({OK}) if max_attempts <= 1000 else frozenset({OK, VE}),
        f"pool default_retry max_attempts={max_attempts}",
    )
    if kind == OK:
        assert app.pool(name).configure().default_retry == retry
    else:
        assert snapshot(app, store_url) == before


# --- run_worker arguments ---------------------------------------------------------------------


def pools_oracle(value: object) -> Allowed:
    if value is None:
        return frozenset({OK})
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        return frozenset({TE})
    return allowed(*(name_oracle(v) for v in value))


WORKER_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "pools": tagged(
            st.one_of(
                st.none(),
                JUNK,
                st.lists(st.one_of(TEXT, st.sampled_from(["p", "other"]), JUNK), max_size=3),
                st.just(["p"]),
                st.just([]),
            ),
            pools_oracle,
        ),
        "concurrency": tagged(
            st.one_of(JUNK.filter(lambda v: not isinstance(v, int) or v <= 4), st.integers(-2, 4)),
            lambda v: frozenset({OK}) if v is None else int_oracle(v, 1, MAX_CONCURRENCY),
        ),
        "until_idle": tagged(
            st.one_of(st.just(True), JUNK.filter(lambda v: v is not False)),
            lambda v: frozenset({OK if v is True else TE}),
        ),
        "lease": tagged(
            st.one_of(SECONDS_VALUES, st.sampled_from([0.05, 0.1, 0.5, 2.0])),
            lambda v: seconds_oracle(v, minimum=0.1, maximum=ONE_DAY),
        ),
        "shutdown_grace": tagged(
            SECONDS_VALUES, lambda v: seconds_oracle(v, minimum=0.0, maximum=ONE_DAY)
        ),
    },
)


@settings(FUZZ, max_examples=30)
@given(args=WORKER_ARGS)
@example(args={"until_idle": (True, frozenset({OK})), "shutdown_grace": (1e300, frozenset({VE}))})
@example(args={"until_idle": (True, frozenset({OK})), "concurrency": ("2", frozenset({TE}))})
@example(args={"until_idle": (True, frozenset({OK})), "lease": (10**400, frozenset({VE}))})
def test_run_worker_arguments(
    app: workpool.App, store_url: str, fns: dict[str, Any], args: dict[str, Any]
) -> None:
    """Bad arguments are refused before a worker starts; good ones run (until idle)."""
    kwargs = {key: value for key, (value, _) in args.items()}
    expected = allowed(*(oracle for _, oracle in args.values()))
    if OK in expected:
        kwargs["until_idle"] = True  # a valid worker returns at once on an empty store
    before = snapshot(app, store_url)
    result: list[tuple[Any, Any]] = []
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(outcome(lambda: app.run_worker(**kwargs)))
        except BaseException as exc:
            crashed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20.0)
    if thread.is_alive():
        app.stop_workers()
        thread.join(10.0)
        raise AssertionError(f"run_worker({show(kwargs)}) did not return")
    assert not crashed, f"run_worker({show(kwargs)}) raised {crashed[0]!r}"
    kind, value = result[0]
    assert kind in expected, f"run_worker({show(kwargs)}): {kind}, {show(value)}"
    if kind != OK:
        assert snapshot(app, store_url) == before


# --- rows in the database that the worker cannot run ---------------------------------------


def seed(app: workpool.App, url: str, pool: str, **columns: Any) -> str:
    """Insert a pending row straight into ``work`` (and on SQLite its ``payloads`` row),
    as someone with write access could."""
    row = {
        "id": str(uuid.uuid4()),
        "pool": pool,
        "kind": "action",
        "fn_name": "job",
        "args": "{}",
        "on_complete": None,
        "context": None,
        "retry": None,
        "timeout": None,
        "state": "pending",
        "due_at": time.time() - 1,
        "attempt": 0,
        "cancel_requested": 0,
        "handler_failures": 0,
        "lost_count": 0,
        "enqueued_at": time.time() - 1,
        **columns,
    }
    schema = pg_schema_of(url)
    prefix = f'"{schema}".' if schema else ""
    p = ph(url)
    tables: list[tuple[str, dict[str, Any]]] = [("work", row)]
    if not schema:  # SQLite keeps args and context in their own table
        payload = {"id": row["id"], "args": row.pop("args"), "context": row.pop("context")}
        tables.insert(0, ("payloads", payload))
    with app.transaction() as tx:
        for table, values in tables:
            tx.execute(
                f"INSERT INTO {prefix}{table} ({', '.join(values)})"
                f" VALUES ({', '.join([p] * len(values))})",
                tuple(values.values()),
            )
    return row["id"]


class Worker:
    """``app.run_worker(until_idle=True)`` in a thread, with a deadline."""

    def __init__(self, app: workpool.App, **kwargs: Any) -> None:
        self.app = app
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)

    def _run(self, **kwargs: Any) -> None:
        try:
            self.app.run_worker(until_idle=True, lease=2.0, **kwargs)
        except BaseException as exc:
            self.errors.append(exc)

    def run(self, timeout: float) -> bool:
        """True if the worker became idle and returned cleanly within ``timeout``."""
        self.thread.start()
        self.thread.join(timeout)
        if self.thread.is_alive():
            for _ in range(100):
                self.app.stop_workers()
                self.thread.join(0.1)
                if not self.thread.is_alive():
                    break
            return False
        assert not self.errors, f"the worker crashed: {self.errors[0]!r}"
        return True


UNREGISTERED_NAMES = st.one_of(
    st.sampled_from(
        [
            "os.system",
            "os:system",
            "subprocess.run",
            "builtins.eval",
            "builtins.exec",
            "__import__",
            "pickle.loads",
            "x'; DROP TABLE work; --",
            "tests.test_fuzz_inputs._unregistered",
            "mut",  # registered, but as a mutation
            "",
        ]
    ),
    st.text(max_size=30).filter(lambda s: s not in ("job", "mut", "qry", "on_done")),
)
CORRUPT_ARGS = st.one_of(
    st.sampled_from(
        [
            "",
            "{",
            "{not json",
            "null",
            "[]",
            "[1, 2]",
            '"a string"',
            "42",
            "true",
            "{'single': 'quotes'}",
            '{"a": 1,}',
            "\x00",
            "x'; DROP TABLE work; --",
        ]
    ),
    st.text(max_size=30).filter(lambda s: not _is_json_object(s)),
)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@settings(FUZZ, max_examples=6)
@given(
    bad_names=st.lists(UNREGISTERED_NAMES, min_size=1, max_size=3),
    bad_args=st.lists(CORRUPT_ARGS, min_size=1, max_size=3),
    kind=st.sampled_from(["action", "query", "evil", "", "x'; DROP TABLE work; --"]),
    args_kind=st.sampled_from(["action", "mutation"]),
)
def test_rows_naming_unregistered_functions_or_holding_corrupt_args_fail_cleanly(
    app: workpool.App,
    store_url: str,
    fns: dict[str, Any],
    bad_names: list[str],
    bad_args: list[str],
    kind: str,
    args_kind: str,
) -> None:
    """Each such row finishes Failed; good work in the same pool succeeds; nothing else moves."""
    app.clock = time.time  # a real worker runs here: real time
    pg = pg_schema_of(store_url) is not None
    if pg:  # PostgreSQL text cannot hold NUL: such rows cannot exist there
        bad_names = [n for n in bad_names if "\x00" not in n]
        bad_args = [a for a in bad_args if "\x00" not in a]
    pool = app.pool("mixed")
    good = pool.enqueue_action("job", {"i": 1})
    bad = [seed(app, store_url, "mixed", fn_name=n, kind=kind) for n in bad_names]
    fn_name = "job" if args_kind == "action" else "mut"
    bad += [
        seed(app, store_url, "mixed", args=a, kind=args_kind, fn_name=fn_name) for a in bad_args
    ]
    # A scheduled item of another pool must stay exactly as it is.
    other = app.pool("elsewhere", max_parallelism=0)
    parked = other.enqueue_action("job", {"i": 2})
    parked_before = other.status(parked)
    good_after = pool.enqueue_action("job", {"i": 3})
    assert Worker(app).run(timeout=30.0), "run_worker(until_idle=True) did not become idle"
    for wid in bad:
        status = pool.status(wid)
        assert status.state == "finished", status
        assert isinstance(status.result, workpool.Failed), status
        assert status.result.error, status
    for wid in (good, good_after):
        assert pool.status(wid) == workpool.Finished(workpool.Success("done"))
    assert other.status(parked) == parked_before


@pytest.mark.parametrize(
    "case",
    [
        pytest.param({"args": "[" * 100_000 + "]" * 100_000}, id="deeply-nested-args"),
        pytest.param({"on_complete": "on_done", "context": "{corrupt"}, id="corrupt-context"),
    ],
)
def test_a_poisoned_row_fails_alone_and_the_pool_keeps_running(
    app: workpool.App, store_url: str, fns: dict[str, Any], case: dict[str, Any]
) -> None:
    """JSON a worker cannot decode (too deep for the parser, or not JSON at all, in a
    column other than args) must fail that one item, not the worker or its pool."""
    app.clock = time.time  # a real worker runs here: real time
    pool = app.pool("poison", max_parallelism=2)
    bad = seed(app, store_url, "poison", **case)
    goods = [pool.enqueue_action("job", {"i": i}) for i in range(3)]
    idle = Worker(app, shutdown_grace=0.5).run(timeout=4.0)
    for wid in goods:
        assert pool.status(wid) == workpool.Finished(workpool.Success("done")), wid
    status = pool.status(bad)
    assert status.state == "finished", f"the poisoned item is stuck: {status}"
    assert isinstance(status.result, workpool.Failed | workpool.Success), status
    assert idle, "the worker never became idle"


def test_work_whose_stored_payload_went_missing_fails_alone(
    app: workpool.App, store_url: str, fns: dict[str, Any]
) -> None:
    """Big args and contexts live in a payloads row, read after the claim's COMMIT:
    work whose row went missing fails (its args "" are corrupt) with the reason,
    alone, and its neighbours in the same claim succeed."""
    schema = pg_schema_of(store_url)
    app.clock = time.time  # a real worker runs here: real time
    pool = app.pool("lost", max_parallelism=5)
    big = {"pad": "x" * 2_100}
    lost = pool.enqueue_action("job", big, on_complete="on_done", context=big)
    goods = [pool.enqueue_action("job", big), pool.enqueue_action("job", {"i": 1})]
    with app.transaction() as tx:
        prefix = f'"{schema}".' if schema else ""
        tx.execute(f"DELETE FROM {prefix}payloads WHERE id = {ph(store_url)}", (lost,))
    assert Worker(app).run(timeout=30.0), "run_worker(until_idle=True) did not become idle"
    status = pool.status(lost)
    assert isinstance(status.result, workpool.Failed), status
    assert status.result.error, status
    for wid in goods:
        assert pool.status(wid) == workpool.Finished(workpool.Success("done")), wid


class Unprintable(Exception):
    """An exception whose message cannot be computed."""

    def __str__(self) -> str:
        raise RuntimeError("no message for you")


def test_an_exception_that_cannot_be_printed_fails_its_attempt_only(
    app: workpool.App, store_url: str, fns: dict[str, Any]
) -> None:
    """User code is input too: an action raising an exception whose str() raises must
    fail that attempt, not kill an executor thread and hold its slot forever."""
    app.clock = time.time

    @app.action(name="unprintable")
    def unprintable() -> None:
        raise Unprintable()

    pool = app.pool("unprintable", max_parallelism=1)
    bad = pool.enqueue_action(unprintable)
    good = pool.enqueue_action("job")
    idle = Worker(app, shutdown_grace=0.5).run(timeout=4.0)
    status = pool.status(bad)
    assert status.state == "finished" and isinstance(status.result, workpool.Failed), status
    assert pool.status(good) == workpool.Finished(workpool.Success("done"))
    assert idle


def test_error_messages_with_nul_bytes_are_recorded(
    app: workpool.App, store_url: str, fns: dict[str, Any]
) -> None:
    """An action or on_complete raising a message with a NUL byte: PostgreSQL text
    columns cannot hold NUL, yet the retry must still happen and the handler failure
    must still be recorded -- without stalling the worker's completer."""
    app.clock = time.time
    calls: list[int] = []

    @app.action(name="nul_action")
    def nul_action() -> None:
        calls.append(workpool.current().attempt)
        raise ValueError("bad\x00byte")

    @app.mutation(name="nul_handler")
    def nul_handler(tx: workpool.Tx, work_id: str, context: Any, result: Any) -> None:
        raise ValueError("handler\x00failed")

    pool = app.pool("nul")
    retried = pool.enqueue_action(nul_action, retry=RetryBehavior(3, 0.0, 1.0))
    handled = pool.enqueue_action("job", on_complete=nul_handler)
    good = pool.enqueue_action("job")
    # The handler is retried with backoff for seconds: look after 3 s, idle or not.
    Worker(app, shutdown_grace=0.5).run(timeout=3.0)
    assert calls == [1, 2, 3]
    status = pool.status(retried)
    assert status.state == "finished" and isinstance(status.result, workpool.Failed), status
    assert status.result.error.startswith("ValueError: bad"), status
    assert pool.status(good) == workpool.Finished(workpool.Success("done"))
    info = app.inspect(handled)
    assert info is not None and info.state == "completing", info  # failure recorded
    assert info.last_error is not None and info.last_error.startswith("ValueError: handler")


@pytest.mark.parametrize("how", ["completer", "rescuer"])
def test_a_retry_policy_with_a_huge_base_retries_as_promised(
    app: workpool.App, store_url: str, fns: dict[str, Any], how: str
) -> None:
    """RetryBehavior accepts base=1e300; the wait before the third retry must be capped
    (at a day), not overflow inside the completer (which then records 'could not
    record the result') or inside the rescuer (which then rescues nothing at all)."""
    from workpool.runtime.completion import Changes, Completion

    calls: list[int] = []

    @app.action(name="flaky")
    def flaky() -> None:
        calls.append(workpool.current().attempt)
        raise ValueError("again")

    retry = RetryBehavior(max_attempts=4, initial_backoff=0.0, base=1e300)
    pool = app.pool("huge")
    if how == "completer":
        app.clock = time.time  # a real worker runs here: real time
        wid = pool.enqueue_action(flaky, retry=retry)
        Worker(app).run(timeout=20.0)
        assert pool.status(wid) == workpool.Finished(workpool.Failed("ValueError: again"))
        assert calls == [1, 2, 3, 4]
        return
    # The rescuer: each attempt is claimed by a worker that has no lease row (lost at
    # once); the clock stands still, so with waits of 0 s each retry is due at once.
    store = app.store
    completion = Completion(store, app.registry, lambda p: "REPORT", rand=lambda: 0.5)
    wid = pool.enqueue_action(flaky, retry=retry)

    def rescue(tx: workpool.Tx) -> None:
        changes = Changes()
        for work in store.lost_work(tx, ["huge"], NOW, 32):
            completion.rescue(tx, work, NOW, changes)
        changes.flush(store, tx, "rescuer", NOW)

    error: Exception | None = None
    for attempt in (1, 2, 3):
        if attempt == 3:  # lost in the same rescue batch as the third attempt
            other = pool.enqueue_action(flaky, retry=False)
        claimed = store.run(lambda tx: store.claim(tx, "huge", 10, "ghost", NOW))
        assert wid in [c.id for c in claimed], attempt
        try:
            store.run(rescue)
        except Exception as exc:
            error = exc
    assert (pool.status(other), error) == (
        workpool.Finished(workpool.Failed("worker lost")),
        None,
    )
    status = pool.status(wid)
    assert status.state == "pending" and status.previous_attempts == 3, status


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """Workers print events to stderr when nothing is configured; keep test output short."""
    import logging

    logger = logging.getLogger("workpool")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
