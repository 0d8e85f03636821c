-- Callers' numbered sessions per run (Alembic migration 0017): `run_sessions` is the server's alone.
--
-- Its rows say which pipelined call of a client session holds its run's ticket: bookkeeping no client role may read
-- or write. No grant exists (the first file's default privileges revoked them); row-level security with a deny-all
-- policy keeps it closed even if a grant is added by mistake. Apply after `signal migrate`: `supabase db push`.
-- Re-running it is harmless.

alter table public.run_sessions enable row level security;
revoke all on public.run_sessions from anon, authenticated;

drop policy if exists "run_sessions: no client access" on public.run_sessions;
create policy "run_sessions: no client access" on public.run_sessions
  as restrictive for all to anon, authenticated using (false) with check (false);
