-- Dashboard sessions (Alembic migration 0011): the `sessions` table is the server's alone.
--
-- Its rows are who is signed in where (a hash of each browser's session id, its user agent): no client role may
-- read or write them. No grant exists (the first file's default privileges revoked them); row-level security with
-- a deny-all policy keeps it closed even if a grant is added by mistake. Apply after `signal migrate`:
-- `supabase db push`. Re-running it is harmless.

alter table public.sessions enable row level security;
revoke all on public.sessions from anon, authenticated;

drop policy if exists "sessions: no client access" on public.sessions;
create policy "sessions: no client access" on public.sessions
  as restrictive for all to anon, authenticated using (false) with check (false);
