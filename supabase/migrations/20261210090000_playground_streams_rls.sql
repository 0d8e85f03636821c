-- The playground's pending streams (Alembic migration 0016): `playground_streams` is the server's alone.
--
-- Its rows are prompts on their way to a stream (a hash of each one-time id, the user's prompt and sample): no client
-- role may read or write them. No grant exists (the first file's default privileges revoked them); row-level security
-- with a deny-all policy keeps it closed even if a grant is added by mistake. Apply after `signal migrate`:
-- `supabase db push`. Re-running it is harmless.

alter table public.playground_streams enable row level security;
revoke all on public.playground_streams from anon, authenticated;

drop policy if exists "playground_streams: no client access" on public.playground_streams;
create policy "playground_streams: no client access" on public.playground_streams
  as restrictive for all to anon, authenticated using (false) with check (false);
