-- Base-model samples (Alembic migration 0012): `base_samples` is a user's history of samples on a base model alone.
--
-- The server serves it (GraphQL `baseSamples`, with the caller's key); no client role reads or writes it directly.
-- No grant exists (the first file's default privileges revoked them); row-level security with a deny-all policy
-- keeps it closed even if a grant is added by mistake. Apply after `signal migrate`: `supabase db push`. Re-running
-- it is harmless.

alter table public.base_samples enable row level security;
revoke all on public.base_samples from anon, authenticated;

drop policy if exists "base_samples: no client access" on public.base_samples;
create policy "base_samples: no client access" on public.base_samples
  as restrictive for all to anon, authenticated using (false) with check (false);
