// wantrain serve: the data view. The clips of a run's data folders (the run page's Data tab) or of a folder given
// to `wantrain serve --data` (#/data/K), each with a strip of frames and its caption, which a person edits and
// saves (POST /api/data/caption with the token header, like the controls; the server writes it atomically).
"use strict";

function dataQuery(source) {
  return source.run !== undefined ? `run=${encodeURIComponent(source.run)}` : `folder=${source.folder}`;
}

async function showClips(source, container) {
  container.replaceChildren(el("p", {class: "hint"}, "reading the clips…"));
  let data;
  try { data = await api(`/api/data?${dataQuery(source)}`); } catch (e) {
    container.replaceChildren(el("p", {class: "problems"}, e.message)); return;
  }
  const parts = [];
  for (const folder of data.folders) {
    const captioned = folder.clips.filter(c => c.caption !== null).length;
    parts.push(el("h2", {}, `${folder.path} — ${folder.clips.length} clips, ${captioned} captioned`));
    parts.push(...folder.clips.map(c => clipBox(source, folder, c)));
  }
  if (!data.folders.length) parts.push(el("p", {}, "This run names no data folder (a metadata file holds its captions)."));
  container.replaceChildren(...parts);
}

function clipBox(source, folder, c) {
  const q = `${dataQuery(source)}&f=${folder.index}&clip=${encodeURIComponent(c.clip)}`;
  const text = el("textarea", {rows: 3, class: "caption", placeholder: "no caption yet"});
  text.value = c.caption === null ? "" : c.caption.trim();
  const msg = el("span", {class: "saved"});
  const save = el("button", {class: "save-caption", onclick: async () => {
    msg.textContent = "saving…";
    try {
      await api("/api/data/caption", {method: "POST",
        headers: {"Content-Type": "application/json", "X-Wantrain-Token": TOKEN},
        body: JSON.stringify({...source, f: folder.index, clip: c.clip, text: text.value})});
      msg.textContent = "saved"; box.classList.remove("edited");
    } catch (e) { msg.textContent = `not saved: ${e.message}`; }
  }}, "Save caption");
  if (READ_ONLY) { save.disabled = true; text.readOnly = true; save.title = "the server is read-only"; }
  text.addEventListener("input", () => { box.classList.add("edited"); msg.textContent = ""; });
  const m = c.manifest;
  const facts = m ? `${m.source} · scene ${m.scene} · ${fmt(m.start_time)}–${fmt(m.end_time)} s · ${m.frames} frames at ${fmt(m.fps)} fps` +
    (m.cut_score !== null && m.cut_score !== undefined ? ` · cut score ${fmt(m.cut_score, 3)}` : "") : c.kind;
  const box = el("div", {class: "clip", "data-clip": c.clip},
    el("div", {class: "clip-head"}, el("b", {}, c.clip), el("span", {class: "hint"}, facts)),
    el("img", {class: "strip", loading: "lazy", alt: `frames of ${c.clip}`, src: `/api/data/strip?${q}`}),
    text, el("div", {}, save, msg));
  return box;
}

async function showFolder(index) {
  stopPolling();
  $("#runs-view").hidden = true; $("#run-view").hidden = true; $("#data-view").hidden = false;
  $("#data-title").textContent = `Prepared folder ${index}`;
  await showClips({folder: index}, $("#folder-clips"));
}

function showFolders(paths) {
  $("#folders").hidden = !paths.length;
  $("#folder-list").replaceChildren(...paths.map((p, i) => el("li", {}, el("a", {href: `#/data/${i}`}, p))));
}
