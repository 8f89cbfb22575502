(function () {
  var root = document.getElementById("%(id)s");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  function q(sel) { return root.querySelector(sel); }
  var frames = root.querySelectorAll("img.pl-frame");
  var n = frames.length, cur = %(start)d, timer = null, interval = %(interval)d;
  var slider = q(".pl-slider"), label = q(".pl-label"), play = q(".pl-play"), speed = q(".pl-speed");
  function show(k) {
    k = Math.max(0, Math.min(n - 1, k));
    for (var j = 0; j < n; j++) frames[j].style.display = (j === k) ? "block" : "none";
    cur = k;
    slider.value = String(k);
    label.textContent = "step " + frames[k].getAttribute("data-step") + "  (frame " + (k + 1) + " of " + n + ")";
    root.setAttribute("data-frame", String(k));
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "\u25b6 play";
  }
  function tick() { if (cur >= n - 1) stop(); else show(cur + 1); }
  function start() {
    stop();
    if (cur >= n - 1) show(0);
    timer = setInterval(tick, interval / (parseFloat(speed.value) || 1));
    play.textContent = "\u275a\u275a pause";
  }
  var acts = {
    first: function () { stop(); show(0); },
    prev: function () { stop(); show(cur - 1); },
    play: function () { if (timer !== null) stop(); else start(); },
    next: function () { stop(); show(cur + 1); },
    last: function () { stop(); show(n - 1); }
  };
  var buttons = root.querySelectorAll("button[data-act]");
  for (var b = 0; b < buttons.length; b++) {
    buttons[b].addEventListener("click", (function (act) {
      return function (e) { e.preventDefault(); acts[act](); };
    })(buttons[b].getAttribute("data-act")));
  }
  slider.addEventListener("input", function () { stop(); show(parseInt(slider.value, 10)); });
  speed.addEventListener("change", function () { if (timer !== null) start(); });
  var keys = { ArrowRight: "next", ArrowLeft: "prev", Home: "first", End: "last", " ": "play" };
  root.addEventListener("keydown", function (e) {
    var act = keys[e.key], tag = (e.target && e.target.tagName) || "";
    if (!act || tag === "SELECT" || (tag === "BUTTON" && e.key === " ")) return;
    e.preventDefault();
    e.stopPropagation();
    acts[act]();
  });
  q(".pl-controls").style.display = "flex";
  q(".pl-static").style.display = "none";
  show(cur);
})();
