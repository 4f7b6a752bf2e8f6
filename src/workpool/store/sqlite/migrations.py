"""SQLite schema migrations, applied in order; ``PRAGMA user_version`` records the last one."""

from __future__ import annotations

MIGRATIONS: list[str] = [
    """
    CREATE TABLE pools (
        name TEXT PRIMARY KEY,
        max_parallelism INTEGER NOT NULL,
        retry_actions_by_default INTEGER NOT NULL,
        max_attempts INTEGER NOT NULL,
        initial_backoff REAL NOT NULL,
        base REAL NOT NULL,
        log_level TEXT NOT NULL,
        status_ttl REAL NOT NULL,
        paused_from INTEGER
    );
    CREATE TABLE duties (
        pool TEXT NOT NULL,
        duty TEXT NOT NULL,
        next_at REAL NOT NULL,
        PRIMARY KEY (pool, duty)
    );
    -- Active work only (pending, running, completing): the table every claim reads.
    CREATE TABLE work (
        id TEXT PRIMARY KEY,
        pool TEXT NOT NULL,
        kind TEXT NOT NULL,
        fn_name TEXT NOT NULL,
        args TEXT NOT NULL,
        on_complete TEXT,
        context TEXT,
        retry TEXT,
        timeout REAL,
        state TEXT NOT NULL,
        due_at REAL NOT NULL,
        attempt INTEGER NOT NULL,
        worker_id TEXT,
        started_at REAL,
        cancel_requested INTEGER NOT NULL,
        last_error TEXT,
        result TEXT,
        handler_failures INTEGER NOT NULL,
        lost_count INTEGER NOT NULL,
        enqueued_at REAL NOT NULL
    );
    -- One index serves claims (pending by due time), the running count, handler
    -- retries and the rescuer: every hot query has equality on (pool, state). SQLite
    -- keeps no statistics by default, so a single index that matches them all is what
    -- its planner reliably picks, and every extra index would slow every enqueue.
    CREATE INDEX work_due ON work (pool, state, due_at, id);
    -- Finished work and its result, kept for the pool's status_ttl.
    CREATE TABLE finished (
        id TEXT PRIMARY KEY,
        pool TEXT NOT NULL,
        fn_name TEXT NOT NULL,
        kind TEXT NOT NULL,
        args TEXT NOT NULL,
        on_complete TEXT,
        outcome TEXT NOT NULL,
        result TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        enqueued_at REAL NOT NULL,
        finished_at REAL NOT NULL,
        last_error TEXT,
        handler_error TEXT
    );
    CREATE INDEX finished_age ON finished (pool, finished_at);
    CREATE INDEX finished_outcome ON finished (pool, outcome, finished_at);
    CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        pools TEXT NOT NULL,
        started_at REAL NOT NULL,
        heartbeat_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE TABLE counters (
        pool TEXT NOT NULL,
        worker_id TEXT NOT NULL,
        bucket INTEGER NOT NULL,
        completed INTEGER NOT NULL,
        succeeded INTEGER NOT NULL,
        failed INTEGER NOT NULL,
        retries INTEGER NOT NULL,
        canceled INTEGER NOT NULL,
        lag_count INTEGER NOT NULL,
        lag_sum REAL NOT NULL,
        lag_max REAL NOT NULL,
        lag_h0 INTEGER NOT NULL DEFAULT 0,
        lag_h1 INTEGER NOT NULL DEFAULT 0,
        lag_h2 INTEGER NOT NULL DEFAULT 0,
        lag_h3 INTEGER NOT NULL DEFAULT 0,
        lag_h4 INTEGER NOT NULL DEFAULT 0,
        lag_h5 INTEGER NOT NULL DEFAULT 0,
        lag_h6 INTEGER NOT NULL DEFAULT 0,
        lag_h7 INTEGER NOT NULL DEFAULT 0,
        lag_h8 INTEGER NOT NULL DEFAULT 0,
        lag_h9 INTEGER NOT NULL DEFAULT 0,
        lag_h10 INTEGER NOT NULL DEFAULT 0,
        lag_h11 INTEGER NOT NULL DEFAULT 0,
        lag_h12 INTEGER NOT NULL DEFAULT 0,
        lag_h13 INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (pool, worker_id, bucket)
    );
    """,
    # Only recent_failures filters on outcome, and only on 'failed': a partial index
    # gives the common case, a success, one index entry fewer to write.
    """
    DROP INDEX finished_outcome;
    CREATE INDEX finished_failed ON finished (pool, finished_at) WHERE outcome = 'failed';
    """,
    # Args and context move to their own table, written once at enqueue: SQLite
    # rewrites a whole row on every update, so a claim of work with 800 KB of args
    # wrote those 800 KB again (26 ms a claim), and finishing copied them into
    # finished. Written for any SQLite: tables are rebuilt, not altered.
    """
    CREATE TABLE payloads (
        id TEXT PRIMARY KEY,
        context TEXT,
        args TEXT NOT NULL
    );
    INSERT INTO payloads (id, context, args) SELECT id, context, args FROM work;
    INSERT OR IGNORE INTO payloads (id, context, args) SELECT id, NULL, args FROM finished;
    CREATE TABLE work_v3 (
        id TEXT PRIMARY KEY,
        pool TEXT NOT NULL,
        kind TEXT NOT NULL,
        fn_name TEXT NOT NULL,
        on_complete TEXT,
        retry TEXT,
        timeout REAL,
        state TEXT NOT NULL,
        due_at REAL NOT NULL,
        attempt INTEGER NOT NULL,
        worker_id TEXT,
        started_at REAL,
        cancel_requested INTEGER NOT NULL,
        last_error TEXT,
        result TEXT,
        handler_failures INTEGER NOT NULL,
        lost_count INTEGER NOT NULL,
        enqueued_at REAL NOT NULL
    );
    INSERT INTO work_v3 SELECT id, pool, kind, fn_name, on_complete, retry, timeout, state,
        due_at, attempt, worker_id, started_at, cancel_requested, last_error, result,
        handler_failures, lost_count, enqueued_at FROM work;
    DROP TABLE work;
    ALTER TABLE work_v3 RENAME TO work;
    CREATE INDEX work_due ON work (pool, state, due_at, id);
    CREATE TABLE finished_v3 (
        id TEXT PRIMARY KEY,
        pool TEXT NOT NULL,
        fn_name TEXT NOT NULL,
        kind TEXT NOT NULL,
        on_complete TEXT,
        outcome TEXT NOT NULL,
        result TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        enqueued_at REAL NOT NULL,
        finished_at REAL NOT NULL,
        last_error TEXT,
        handler_error TEXT
    );
    INSERT INTO finished_v3 SELECT id, pool, fn_name, kind, on_complete, outcome, result,
        attempts, enqueued_at, finished_at, last_error, handler_error FROM finished;
    DROP TABLE finished;
    ALTER TABLE finished_v3 RENAME TO finished;
    CREATE INDEX finished_age ON finished (pool, finished_at);
    CREATE INDEX finished_failed ON finished (pool, finished_at) WHERE outcome = 'failed';
    """,
    # Small args and context back in the work row (and args in the finished row),
    # NULL where payloads holds them: the payload row was a third of the pages a single
    # enqueue wrote (5 b-tree pages in all), and a second read at every claim. Rows
    # written before keep theirs in payloads, as their NULL args say.
    """
    ALTER TABLE work ADD COLUMN args TEXT;
    ALTER TABLE work ADD COLUMN context TEXT;
    ALTER TABLE finished ADD COLUMN args TEXT;
    """,
]
