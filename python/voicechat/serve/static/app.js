// The browser client: microphone -> PCM16 at 24 kHz -> /v1/realtime; answer audio played as it
// arrives through a small jitter buffer; the user's transcript, the answer and the function text live.
"use strict";
const RATE = 24000;          // both directions: the Realtime API's PCM rate
const JITTER_SECONDS = 0.12; // audio is scheduled this far ahead of the play clock

const $ = (id) => document.getElementById(id);
const state = { ws: null, ctx: null, stream: null, node: null, muted: false, playAt: 0, played: 0, received: 0 };
window.voicechat = state;  // for tests and the curious: counts of samples received and played

function setStatus(text) { $("status").textContent = text; }

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(b64) {
  const s = atob(b64);
  const bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return new Int16Array(bytes.buffer);
}

function send(event) {
  if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(event));
}

function play(int16) {
  const ctx = state.ctx;
  const samples = new Float32Array(int16.length);
  for (let i = 0; i < int16.length; i++) samples[i] = int16[i] / 32768;
  const buffer = ctx.createBuffer(1, samples.length, RATE);
  buffer.copyToChannel(samples, 0);
  const source = ctx.createBufferSource();
  source.buffer = buffer;
  source.connect(ctx.destination);
  state.playAt = Math.max(state.playAt, ctx.currentTime + JITTER_SECONDS);
  source.start(state.playAt);
  state.playAt += buffer.duration;
  source.onended = () => { state.played += samples.length; };
  state.received += samples.length;
}

function onEvent(event) {
  switch (event.type) {
    case "session.created": setStatus("connected: listening"); break;
    case "conversation.item.input_audio_transcription.delta": $("transcript").textContent += event.delta; break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta": $("text").textContent += event.delta; break;
    case "response.function_call_arguments.delta": $("function").textContent += event.delta; break;
    case "response.output_audio.delta": play(fromBase64(event.delta)); break;
    case "response.done": setStatus("answer done"); break;
    case "error": $("error").textContent = event.error.message; break;
  }
}

async function start() {
  $("error").textContent = "";
  $("start").disabled = true;
  try {
    state.ctx = new AudioContext({ sampleRate: RATE });
    await state.ctx.audioWorklet.addModule("/static/capture-worklet.js");
    state.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  } catch (e) {
    $("error").textContent = "microphone: " + e.message;
    $("start").disabled = false;
    return;
  }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const key = new URLSearchParams(location.search).get("key");
  const protocols = ["realtime"].concat(key ? ["openai-insecure-api-key." + key] : []);
  state.ws = new WebSocket(`${scheme}://${location.host}/v1/realtime`, protocols);
  state.ws.onmessage = (m) => onEvent(JSON.parse(m.data));
  state.ws.onclose = (e) => { setStatus(`disconnected (${e.code})`); stop(false); };
  state.ws.onopen = () => {
    const prompt = $("prompt").value.trim();
    send({ type: "session.update", session: { type: "realtime", instructions: prompt,
      audio: { input: { format: { type: "audio/pcm", rate: RATE } }, output: { format: { type: "audio/pcm", rate: RATE } } } } });
    const source = state.ctx.createMediaStreamSource(state.stream);
    state.node = new AudioWorkletNode(state.ctx, "capture");
    state.node.port.onmessage = (m) => {
      if (state.muted) m.data.fill(0);  // muted: the model still hears time pass, as silence
      const pcm = new Int16Array(m.data.length);
      for (let i = 0; i < pcm.length; i++) pcm[i] = Math.max(-32768, Math.min(32767, Math.round(m.data[i] * 32767)));
      send({ type: "input_audio_buffer.append", audio: toBase64(pcm) });
    };
    source.connect(state.node);
    $("stop").disabled = false;
    $("mute").disabled = false;
  };
}

function stop(commit = true) {
  if (commit) send({ type: "input_audio_buffer.commit" });
  if (state.node) { state.node.port.onmessage = null; state.node.disconnect(); state.node = null; }
  if (state.stream) { state.stream.getTracks().forEach((t) => t.stop()); state.stream = null; }
  $("start").disabled = false;
  $("stop").disabled = true;
  $("mute").disabled = true;
}

$("start").onclick = start;
$("stop").onclick = () => stop(true);
$("mute").onclick = () => {
  state.muted = !state.muted;
  $("mute").textContent = state.muted ? "Unmute" : "Mute";
};
