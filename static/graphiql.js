// The GraphQL explorer on /graphql (templates/graphiql.html); a file, not an inline script, so the page's CSP
// allows scripts from 'self' only.
(function () {
  "use strict";
  const DEFAULT_QUERY = `# Signal's GraphQL API. Signed in to the dashboard, your queries run as you.
# Otherwise (or to act as another key) open "Headers" below and add
#   {"Authorization": "Bearer sk-..."}
# A pasted key is never stored by this page. Try { me { email } }; run with Ctrl-Enter or the play button.
{
  models {
    name
  }
}
`;
  // The page before this one persisted pasted headers (API keys): remove them. GraphiQL 3 reloads a tab's stored
  // headers even when it does not persist new ones.
  function forgetStoredHeaders() {
    localStorage.removeItem("graphiql:headers");
    localStorage.removeItem("graphiql:shouldPersistHeaders");
    const raw = localStorage.getItem("graphiql:tabState");
    if (!raw) return;
    try {
      const state = JSON.parse(raw);
      for (const tab of (state && state.tabs) || []) tab.headers = null;
      localStorage.setItem("graphiql:tabState", JSON.stringify(state));
    } catch (error) {
      localStorage.removeItem("graphiql:tabState");
    }
  }
  forgetStoredHeaders();

  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const url = window.location.origin + window.location.pathname;
  // The session's CSRF token on every request and in the websocket's connectionParams; headers typed into the
  // editor are merged over these, so a pasted Authorization wins.
  const fetcher = GraphiQL.createFetcher({
    url,
    subscriptionUrl: url.replace(/^http/, "ws"),
    headers: { "X-CSRF-Token": csrf },
    wsConnectionParams: { "X-CSRF-Token": csrf },
  });
  ReactDOM.createRoot(document.getElementById("graphiql")).render(
    React.createElement(GraphiQL, {
      fetcher,
      defaultQuery: DEFAULT_QUERY,
      defaultEditorToolsVisibility: true,
      isHeadersEditorEnabled: true,
      shouldPersistHeaders: false,
      headers: "",
    })
  );
})();
