// Preload for `node --import ./auth-preload.mjs`: adds extra HTTP headers to every request the
// conformance tool makes. Covers global fetch (MCP SDK client transport, server-sse-* probes) AND
// undici.request (dns-rebinding-protection), by installing a global undici dispatcher, which
// Node's built-in fetch and the npm `undici` package share (Symbol.for('undici.globalDispatcher.1')).
// Config: MCP_CONFORMANCE_HEADERS='{"Authorization":"Bearer xyz"}'  or  MCP_BEARER_TOKEN=xyz
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

const extra = process.env.MCP_CONFORMANCE_HEADERS
  ? JSON.parse(process.env.MCP_CONFORMANCE_HEADERS)
  : process.env.MCP_BEARER_TOKEN ? { Authorization: `Bearer ${process.env.MCP_BEARER_TOKEN}` } : {};

// Resolve `undici` from the conformance package's node_modules (UNDICI_FROM = a dir inside it).
const req = createRequire(pathToFileURL((process.env.UNDICI_FROM || process.cwd()) + '/'));
const { Agent, setGlobalDispatcher } = req('undici');

function withExtra(headers) {
  const lower = new Set(Object.keys(extra).map((k) => k.toLowerCase()));
  let pairs = [];
  if (Array.isArray(headers)) {               // flat [k, v, k, v] or [[k, v]]
    if (headers.length && Array.isArray(headers[0])) pairs = headers;
    else for (let i = 0; i < headers.length; i += 2) pairs.push([headers[i], headers[i + 1]]);
  } else if (headers && typeof headers[Symbol.iterator] === 'function') pairs = [...headers];
  else if (headers) pairs = Object.entries(headers);
  pairs = pairs.filter(([k]) => !lower.has(String(k).toLowerCase()));
  const out = {};
  for (const [k, v] of pairs) out[k] = v;
  return Object.assign(out, extra);
}

class HeaderAgent extends Agent {
  dispatch(opts, handler) { return super.dispatch({ ...opts, headers: withExtra(opts.headers) }, handler); }
}
if (Object.keys(extra).length) setGlobalDispatcher(new HeaderAgent());
