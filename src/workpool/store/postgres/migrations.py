"""PostgreSQL schema migrations, applied in order under an advisory lock.

``{s}`` is replaced by the quoted schema name followed by a dot.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    """
    CREATE TABLE {s}pools (
        name text PRIMARY KEY,
        max_parallelism integer NOT NULL,
        retry_actions_by_default smallint NOT NULL,
        max_attempts integer NOT NULL,
        initial_backoff double precision NOT NULL,
        base double precision NOT NULL,
        log_level text NOT NULL,
        status_ttl double precision NOT NULL,
        paused_from integer
    );
    CREATE TABLE {s}duties (
        pool text NOT NULL,
        duty text NOT NULL,
        next_at double precision NOT NULL,
        PRIMARY KEY (pool, duty)
    );
    -- Active work only (pending, running, completing): the table every claim reads.
    -- Rows are updated a few times each and then deleted, so leave room for HOT
    -- updates and let autovacuum visit after a fixed number of dead rows, not a
    -- share of the table: claims walk past dead index entries until it does.
    CREATE TABLE {s}work (
        id text PRIMARY KEY,
        pool text NOT NULL,
        kind text NOT NULL,
        fn_name text NOT NULL,
        args text NOT NULL,
        on_complete text,
        context text,
        retry text,
        timeout double precision,
        state text NOT NULL,
        due_at double precision NOT NULL,
        attempt integer NOT NULL,
        worker_id text,
        started_at double precision,
        cancel_requested smallint NOT NULL,
        last_error text,
        result text,
        handler_failures integer NOT NULL,
        lost_count integer NOT NULL,
        enqueued_at double precision NOT NULL
    ) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0,
            autovacuum_vacuum_threshold = 2000, autovacuum_vacuum_insert_scale_factor = 0,
            autovacuum_vacuum_insert_threshold = 5000, autovacuum_analyze_scale_factor = 0,
            autovacuum_analyze_threshold = 5000);
    -- Claims, the running count, handler retries and the rescuer all have equality
    -- on (pool, state); one index serves them all, in due order.
    CREATE INDEX work_due ON {s}work (pool, state, due_at, id);
    -- Finished work and its result, kept for the pool's status_ttl; append-mostly.
    CREATE TABLE {s}finished (
        id text PRIMARY KEY,
        pool text NOT NULL,
        fn_name text NOT NULL,
        kind text NOT NULL,
        args text NOT NULL,
        on_complete text,
        outcome text NOT NULL,
        result text NOT NULL,
        attempts integer NOT NULL,
        enqueued_at double precision NOT NULL,
        finished_at double precision NOT NULL,
        last_error text,
        handler_error text
    );
    CREATE INDEX finished_age ON {s}finished (pool, finished_at);
    CREATE INDEX finished_outcome ON {s}finished (pool, outcome, finished_at);
    CREATE TABLE {s}workers (
        id text PRIMARY KEY,
        host text NOT NULL,
        pid integer NOT NULL,
        pools text NOT NULL,
        started_at double precision NOT NULL,
        heartbeat_at double precision NOT NULL,
        expires_at double precision NOT NULL
    );
    CREATE TABLE {s}counters (
        pool text NOT NULL,
        worker_id text NOT NULL,
        bucket bigint NOT NULL,
        completed bigint NOT NULL,
        succeeded bigint NOT NULL,
        failed bigint NOT NULL,
        retries bigint NOT NULL,
        canceled bigint NOT NULL,
        lag_count bigint NOT NULL,
        lag_sum double precision NOT NULL,
        lag_max double precision NOT NULL,
        lag_h0 bigint NOT NULL DEFAULT 0,
        lag_h1 bigint NOT NULL DEFAULT 0,
        lag_h2 bigint NOT NULL DEFAULT 0,
        lag_h3 bigint NOT NULL DEFAULT 0,
        lag_h4 bigint NOT NULL DEFAULT 0,
        lag_h5 bigint NOT NULL DEFAULT 0,
        lag_h6 bigint NOT NULL DEFAULT 0,
        lag_h7 bigint NOT NULL DEFAULT 0,
        lag_h8 bigint NOT NULL DEFAULT 0,
        lag_h9 bigint NOT NULL DEFAULT 0,
        lag_h10 bigint NOT NULL DEFAULT 0,
        lag_h11 bigint NOT NULL DEFAULT 0,
        lag_h12 bigint NOT NULL DEFAULT 0,
        lag_h13 bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (pool, worker_id, bucket)
    );
    """,
    # Only recent_failures filters on outcome, and only on 'failed': a partial index
    # gives the common case, a success, one index entry fewer to write (drain +8 %).
    """
    DROP INDEX {s}finished_outcome;
    CREATE INDEX finished_failed ON {s}finished (pool, finished_at) WHERE outcome = 'failed';
    """,
    # Payloads over 2 KB are compressed as they are stored. lz4 (PostgreSQL 14+, in
    # most builds) is several times faster than the default pglz: storing 800 KB
    # took 6.5 ms with pglz and 1.1 ms with lz4, reading it back 3.7 and 1.5 ms.
    # Values stored before keep their compression; a server built without lz4
    # keeps pglz.
    """
    DO $$
    BEGIN
        IF current_setting('server_version_num')::int >= 140000 THEN
            EXECUTE 'ALTER TABLE {s}work ALTER args SET COMPRESSION lz4,'
                ' ALTER context SET COMPRESSION lz4, ALTER result SET COMPRESSION lz4';
            EXECUTE 'ALTER TABLE {s}finished ALTER args SET COMPRESSION lz4,'
                ' ALTER result SET COMPRESSION lz4';
        END IF;
    EXCEPTION WHEN feature_not_supported THEN
        NULL;
    END
    $$;
    """,
    # Args and context over INLINE_CHARS live in payloads, written once at enqueue
    # and deleted with their finished row; the work row holds NULL args and the
    # size of both (payload_bytes, for a claim's byte budget). In the work row they
    # were copied into finished at the finish, and a value TOASTed in one table is
    # read and TOASTed anew in another: with 2 KB args a drain ran at 28.5-31.5k
    # jobs/s, 34.2-39.8k with them here. Rows written before keep theirs in place.
    """
    CREATE TABLE {s}payloads (
        id text PRIMARY KEY,
        context text,
        args text NOT NULL
    ) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000,
            autovacuum_vacuum_insert_scale_factor = 0,
            autovacuum_vacuum_insert_threshold = 5000);
    ALTER TABLE {s}work ALTER args DROP NOT NULL, ADD COLUMN payload_bytes integer;
    ALTER TABLE {s}finished ALTER args DROP NOT NULL;
    DO $$
    BEGIN
        IF current_setting('server_version_num')::int >= 140000 THEN
            EXECUTE 'ALTER TABLE {s}payloads ALTER args SET COMPRESSION lz4,'
                ' ALTER context SET COMPRESSION lz4';
        END IF;
    EXCEPTION WHEN feature_not_supported THEN
        NULL;
    END
    $$;
    """,
]
