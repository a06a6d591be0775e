// Text helpers shared by the views' front-ends: ds4lab.viz.base.widget_module puts this file before a view's own ESM
// (as hovertip.js), so these functions are its own.
// s with HTML's special characters escaped, for text put into innerHTML
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
// "a–b" as HTML kept on one line (a browser may break a line after the dash: "positions 0–" then "63")
const fromTo = (a, b) => `<span class="ds4-nowrap">${a}–${b}</span>`;
// "1 row", "2 rows" (many: the plural where it is not one + "s")
const plural = (n, one, many) => `${n} ${n === 1 ? one : many || one + "s"}`;
