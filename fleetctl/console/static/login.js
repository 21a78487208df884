// The sign-in link carries a one-time token in its fragment: post it once, then drop it from the
// address bar and the history before going on.
"use strict";
(async () => {
  const status = document.getElementById("status");
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  history.replaceState(null, "", "/login");
  if (!token) {
    status.textContent = "No sign-in token in this link. Run `fleet console` for a new one.";
    return;
  }
  const answer = await fetch("/session", {
    method: "POST",
    headers: { authorization: `Bearer ${token}`, "x-fleet-console": "1" },
  });
  if (answer.ok) {
    location.replace("/");
    return;
  }
  const body = await answer.json().catch(() => ({}));
  const error = body.error || {};
  status.textContent = `Sign-in refused: ${error.message || answer.status} [${error.code || "error"}]. ` +
    "A link works once and for five minutes: run `fleet console` for a new one.";
})();
