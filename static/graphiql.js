// The GraphQL explorer on /graphql (templates/graphiql.html); a file, not an inline script, so the page's CSP
// allows scripts from 'self' only.
const DEFAULT_QUERY = `# Signal's GraphQL API. Most fields need your API key: open "Headers" below and add
#   {"Authorization": "Bearer sk-..."}
# Run with Ctrl-Enter or the play button.
{
  models {
    name
  }
}
`;
const url = window.location.origin + window.location.pathname;
const fetcher = GraphiQL.createFetcher({
  url,
  subscriptionUrl: url.replace(/^http/, "ws"),
});
ReactDOM.createRoot(document.getElementById("graphiql")).render(
  React.createElement(GraphiQL, {
    fetcher,
    defaultQuery: DEFAULT_QUERY,
    defaultEditorToolsVisibility: true,
    isHeadersEditorEnabled: true,
    shouldPersistHeaders: true,
  })
);
