-- A dashboard session's cookie is stateless (an expiry and a nonce, signed): signing out only
-- cleared it in that browser, and a copy of it stayed good for the rest of its eight hours. A
-- signed-out session's nonce is kept until the session would have expired, and a cookie naming
-- it is no session.
CREATE TABLE dashboard_sessions_signed_out (
    nonce      text        PRIMARY KEY CHECK (length(nonce) = 32),
    expires_at timestamptz NOT NULL
);
