-- payfleet's statements are short (a claim, a webhook's insert: milliseconds), and PostgreSQL
-- compiles a plan with LLVM when its estimated cost passes jit_above_cost, which estimates
-- from a large table's statistics pass easily: the compilation then costs hundreds of
-- milliseconds on a statement that runs in two. Off for this database's new sessions; a role
-- without the right to change its database gets a notice, and can ask its administrator
-- (`ALTER DATABASE ... SET jit = off`).
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET jit = off', current_database());
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'jit stays on for database %: %', current_database(), SQLERRM;
END
$$;
