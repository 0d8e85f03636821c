-- Signal on Supabase: row-level security and client grants.
--
-- Alembic (`signal migrate`) creates and changes the tables; this file creates none. It only
--   1. enables row-level security on every table in `public`,
--   2. lets a signed-in user (role `authenticated`) read their own rows, and
--   3. takes every write away from the client roles (`anon`, `authenticated`).
-- Every write goes through Signal's server (its own database connection, the table owner), so a client
-- holding Supabase's anon key and a user's JWT cannot make itself an admin, plant a checkpoint path, or insert
-- an API key hash of its choosing. `api_keys.key_hash` is readable by no client role.
--
-- Apply after `signal migrate`: `supabase db push`. Re-running it is harmless.

-- 1. Row-level security on every table, named ones and any other in public (none readable without a policy).
alter table public.users enable row level security;
alter table public.api_keys enable row level security;
alter table public.runs enable row level security;
alter table public.metrics enable row level security;
alter table public.samples enable row level security;
alter table public.checkpoints enable row level security;
alter table public.login_links enable row level security;
alter table public.login_attempts enable row level security;
alter table public.alembic_version enable row level security;
do $$
declare t record;
begin
  for t in select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
           where n.nspname = 'public' and c.relkind in ('r', 'p') and not c.relrowsecurity loop
    execute format('alter table public.%I enable row level security', t.relname);
  end loop;
end $$;

-- 3. Clients only read. Supabase grants everything on public's tables to anon and authenticated by default:
-- take it all back, now and for tables the same role creates later (a later Signal migration's new table
-- stays closed to clients until a file like this one opens it).
revoke all on all tables in schema public from anon, authenticated;
revoke all on all sequences in schema public from anon, authenticated;
revoke all on all functions in schema public from anon, authenticated;
alter default privileges in schema public revoke all on tables from anon, authenticated;
alter default privileges in schema public revoke all on sequences from anon, authenticated;
alter default privileges in schema public revoke all on functions from anon, authenticated;

-- 2. What a signed-in user may read (anon: nothing). login_links, login_attempts and alembic_version are the
-- server's alone: no grant, no policy.
grant select on public.users, public.runs, public.metrics, public.samples, public.checkpoints to authenticated;
-- api_keys: the display columns only; key_hash stays unreadable (a column grant, so `select *` is refused too).
grant select (id, user_id, name, prefix, created_at, last_used_at, revoked_at) on public.api_keys to authenticated;

-- Signal's ids are dashed UUID text (migration 0003), the text form of auth.uid(). `(select auth.uid())` is
-- evaluated once per statement rather than once per row.
drop policy if exists "users: read own row" on public.users;
create policy "users: read own row" on public.users
  for select to authenticated using ((select auth.uid())::text = id);

drop policy if exists "api_keys: read own keys" on public.api_keys;
create policy "api_keys: read own keys" on public.api_keys
  for select to authenticated using ((select auth.uid())::text = user_id);

drop policy if exists "runs: read own runs" on public.runs;
create policy "runs: read own runs" on public.runs
  for select to authenticated using ((select auth.uid())::text = user_id);

-- Through the owning run.
drop policy if exists "metrics: read own runs' metrics" on public.metrics;
create policy "metrics: read own runs' metrics" on public.metrics
  for select to authenticated using (exists (
    select 1 from public.runs r where r.id = metrics.run_id and r.user_id = (select auth.uid())::text));

drop policy if exists "samples: read own runs' samples" on public.samples;
create policy "samples: read own runs' samples" on public.samples
  for select to authenticated using (exists (
    select 1 from public.runs r where r.id = samples.run_id and r.user_id = (select auth.uid())::text));

drop policy if exists "checkpoints: read own runs' checkpoints" on public.checkpoints;
create policy "checkpoints: read own runs' checkpoints" on public.checkpoints
  for select to authenticated using (exists (
    select 1 from public.runs r where r.id = checkpoints.run_id and r.user_id = (select auth.uid())::text));
