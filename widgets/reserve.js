// A box that keeps the room it has taken, shared by the views' front-ends: ds4lab.viz.base.widget_module puts this
// file before a view's own ESM (as hovertip.js), so this function is its own.
// keepTallest(el, boxOf): the box boxOf() gives (default el; none: nothing to do) never shrinks below the tallest it
// has been, measured at each hold() and whenever el resizes, so what is under it does not move as its content
// changes. A box measured before it is laid out (JupyterLab draws outputs off-page first) is 0 high: left as it is.
function keepTallest(el, boxOf = () => el) {
  let tallest = 0;
  const hold = () => {
    const box = boxOf();
    if (!box) return;
    tallest = Math.max(tallest, box.offsetHeight);
    if (tallest) box.style.minHeight = `${tallest}px`;
  };
  const sized = new ResizeObserver(hold);
  sized.observe(el);
  return { hold, disconnect: () => sized.disconnect() };
}
