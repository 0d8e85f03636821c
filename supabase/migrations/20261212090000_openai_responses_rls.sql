-- /v1/responses' stored responses (Alembic migration 0018): `openai_responses` is the server's alone.
--
-- Its rows are users' conversations with their models, kept for previous_response_id: the server reads them for their
-- user; no client role may read or write them. No grant exists (the first file's default privileges revoked them);
-- row-level security with a deny-all policy keeps it closed even if a grant is added by mistake. Apply after
-- `signal migrate`: `supabase db push`. Re-running it is harmless.

alter table public.openai_responses enable row level security;
revoke all on public.openai_responses from anon, authenticated;

drop policy if exists "openai_responses: no client access" on public.openai_responses;
create policy "openai_responses: no client access" on public.openai_responses
  as restrictive for all to anon, authenticated using (false) with check (false);
