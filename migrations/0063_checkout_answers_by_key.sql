-- A checkout's links and answer are stored by a function that reaches every order and key by its
-- key, whatever the tables' sizes when it was planned. The receiver prepared the statement on
-- each connection and PostgreSQL kept its plan for the connection's life; planned while the
-- orders were few (a receiver started on a new database), it found a batch's orders by scanning
-- every order, and kept doing so as the orders grew (`auto_explain`, sampled over a deployed
-- `payfleet bench e2e`: 75 of 106 of these statements). A session setting is no way out (behind
-- PgBouncer in transaction mode a connection's startup options are refused and a `SET` lands on
-- another client's server connection), and a transaction of its own costs two more round trips;
-- a function's own settings hold for its call alone. The statement is the one the receiver ran
-- (orders::checkout::store_completions), planned once per connection as before.
CREATE FUNCTION checkout_store_answers(
    link_checkouts int[], link_numbers bigint[], link_attempts int[], link_sessions text[], link_urls text[],
    answer_checkouts int[], answer_owners text[], answer_keys text[], answer_holders text[],
    answers jsonb[], answer_links int[])
RETURNS SETOF int
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- The links on their orders (each order through its number's index, and only where no link
    -- is stored yet for its attempt), then the answers of the checkouts whose links all landed,
    -- each stored with its key only while its request still holds it.
    RETURN QUERY
    WITH l AS (
        UPDATE orders o SET session_id = x.session_id, payment_url = x.url, updated_at = now()
        FROM unnest(link_checkouts, link_numbers, link_attempts, link_sessions, link_urls)
             AS x(c, number, attempt, session_id, url)
        WHERE o.id = ANY(ARRAY(SELECT (SELECT y.id FROM orders y WHERE y.number = n)
                               FROM unnest(link_numbers) AS n))
          AND o.number = x.number AND o.session_id IS NULL
          AND o.payment_attempt = x.attempt
        RETURNING x.c
    ), whole AS (
        SELECT a.c, a.owner, a.key, a.me, a.answer
        FROM unnest(answer_checkouts, answer_owners, answer_keys, answer_holders, answers, answer_links)
             AS a(c, owner, key, me, answer, links)
        WHERE (SELECT count(*) FROM l WHERE l.c = a.c) = a.links
    ), k AS (
        UPDATE idempotency_keys ik SET response = w.answer, locked_until = NULL, locked_by = NULL
        FROM whole w
        WHERE ik.owner = ANY(answer_owners) AND ik.key = ANY(answer_keys)
          AND ik.owner = w.owner AND ik.key = w.key AND ik.locked_by = w.me
    )
    SELECT whole.c FROM whole;
END;
$$;
