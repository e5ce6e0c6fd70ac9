-- An order's link is written in place. Storing the payment link on its order (the last
-- statement of every checkout) set `session_id`, a column of the unique constraint
-- `orders_session_key`, so the update could never stay on its page (a HOT update): every
-- checkout wrote a second version of its order with an entry in each of its indexes, about 490
-- of the 5,900 bytes of write-ahead log a checkout made (`bench e2e`, alternating runs).
--
-- Nothing looks orders up by session: the payment side finds a session's order through
-- `payment_sessions`, whose keys already say that a session belongs to one order and attempt
-- (`payment_sessions_pkey`) and that a gateway's session id is made once
-- (`payment_sessions_session_key`). The order's copy is written only from that table's answer
-- for that very order and attempt. The constraint guarded a copy; the rule stays where the
-- money path reads it.
--
-- Dropping a constraint takes the table's strongest lock for a moment, and every statement on
-- orders that comes after it waits behind it: the release phase gives up after two seconds
-- rather than hold the fleet's checkouts and payments for longer (run `payfleet migrate` again).
SET LOCAL lock_timeout = '2s';
ALTER TABLE orders DROP CONSTRAINT orders_session_key;
