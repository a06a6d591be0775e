// The tooltip shared by the views (AttentionView, KVCacheView, TierView, ExpertView, MaskView, PrefillView):
// ds4lab.viz.base.widget_module puts this file before a view's own ESM, so these functions are its own.
// The tooltip (class ds4-hovertip, shown) beside the pointer at client px (px, py), where the reader looks: right of
// it (left near the right edge of the tooltip's offset parent, its frame), below or above it, whichever side has more
// of the frame in the window; inside the frame, so never cut off.
function placeTip(tip, px, py) {
  const frame = tip.offsetParent;
  tip.style.left = "0px";  // measured at its full width, not squeezed against the frame's edge
  const s = frame.getBoundingClientRect(), tw = tip.offsetWidth, th = tip.offsetHeight;
  const below = py - Math.max(s.top, 0) < Math.min(s.bottom, window.innerHeight) - py;
  const x = px + 14 + tw <= s.right ? px + 14 : Math.max(s.left, px - 14 - tw);
  const y = Math.min(Math.max(below ? py + 18 : py - 12 - th, s.top), s.bottom - th);
  // from the frame's scrolled content box, where an absolute child's left and top start
  tip.style.left = `${x - s.left - frame.clientLeft + frame.scrollLeft}px`;
  tip.style.top = `${y - s.top - frame.clientTop + frame.scrollTop}px`;
}
// What is under the pointer shows in a tooltip beside it (placeTip), at once: by default the data-tip of the
// element under it; textAt(under, x, y) says otherwise (an image's cell, or a text made only when hovered), "" for
// none. describe() re-reads what is under the pointer (after a redraw).
const dataTip = (under) => { const at = under.closest("[data-tip]"); return at ? at.dataset.tip : ""; };
function pointerTip(el, textAt = dataTip) {
  const tip = document.createElement("div"); tip.className = "ds4-hovertip";
  el.style.position = "relative";  // the view is its tooltip's frame (placeTip's offset parent)
  el.append(tip);
  let pointer = null;  // the last pointer position over the view (client px)
  const describe = () => {
    const under = pointer && document.elementFromPoint(pointer.x, pointer.y);
    const text = under && el.contains(under) ? textAt(under, pointer.x, pointer.y) : "";
    tip.style.display = text ? "block" : "none";
    if (text) { tip.textContent = text; placeTip(tip, pointer.x, pointer.y); }
  };
  const move = (ev) => { pointer = { x: ev.clientX, y: ev.clientY }; describe(); };
  const leave = () => { pointer = null; describe(); };
  el.addEventListener("mousemove", move);
  el.addEventListener("mouseleave", leave);
  const remove = () => { el.removeEventListener("mousemove", move); el.removeEventListener("mouseleave", leave); };
  return { describe, remove };
}
