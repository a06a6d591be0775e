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
// An element of the view with a data-tip under the pointer shows it in a tooltip beside the pointer (placeTip), at
// once; describe() re-reads what is under the pointer (after a redraw).
function pointerTip(el) {
  const tip = document.createElement("div"); tip.className = "ds4-hovertip";
  el.append(tip);
  let pointer = null;  // the last pointer position over the view (client px)
  const describe = () => {
    const under = pointer && document.elementFromPoint(pointer.x, pointer.y);
    const at = under && el.contains(under) ? under.closest("[data-tip]") : null;
    tip.style.display = at ? "block" : "none";
    if (at) { tip.textContent = at.dataset.tip; placeTip(tip, pointer.x, pointer.y); }
  };
  const move = (ev) => { pointer = { x: ev.clientX, y: ev.clientY }; describe(); };
  const leave = () => { pointer = null; describe(); };
  el.addEventListener("mousemove", move);
  el.addEventListener("mouseleave", leave);
  const remove = () => { el.removeEventListener("mousemove", move); el.removeEventListener("mouseleave", leave); };
  return { describe, remove };
}
