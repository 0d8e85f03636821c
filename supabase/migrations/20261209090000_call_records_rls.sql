-- Call records (Alembic migration 0014): `call_records` holds one row per applied call, the usage view's source.
--
-- The server serves it (the dashboard's usage page); no client role reads or writes it directly. No grant exists (the
-- first file's default privileges revoked them); row-level security with a deny-all policy keeps it closed even if a
-- grant is added by mistake. Apply after `signal migrate`: `supabase db push`. Re-running it is harmless.

alter table public.call_records enable row level security;
revoke all on public.call_records from anon, authenticated;

drop policy if exists "call_records: no client access" on public.call_records;
create policy "call_records: no client access" on public.call_records
  as restrictive for all to anon, authenticated using (false) with check (false);
