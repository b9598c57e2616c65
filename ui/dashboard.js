// The rate limit dashboard. It reads the JSON admin API through relative URLs
// only, from the page's data-api ("./" for <admin>/rate_limit/ui, whose API
// is <admin>/rate_limit/; "./api/" for the site's console at <base>), so it
// works wherever it is mounted, and it renders every value as text: keys
// are chosen by clients.
'use strict';
(function () {
	const pollMs = 3000;
	const points = 60; // three minutes of history at one point per poll
	const api = document.documentElement.dataset.api || './';
	const byId = (id) => document.getElementById(id);
	const history = new Map(); // zone name -> [{t, total}]
	const countdowns = []; // {cell, reset}
	let selected = new URLSearchParams(location.hash.slice(1)).get('zone') || '';
	let prefix = '';
	let limitedOnly = false;
	// The offenders' order: by refusals in the zone's last five minutes,
	// which outlive a short window, or by requests in the current window.
	let order = 'recent_refusals';
	let busy = false;

	// el builds an element; children that are not nodes become text nodes.
	function el(tag, cls, ...children) {
		const e = document.createElement(tag);
		if (cls) e.className = cls;
		for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
		return e;
	}

	async function call(url, init) {
		const resp = await fetch(url, Object.assign({cache: 'no-store', headers: {Accept: 'application/json'}}, init));
		let body = null;
		try { body = await resp.json(); } catch (e) { /* not JSON */ }
		if (!resp.ok) {
			const msg = body && typeof body.error === 'string' ? body.error : resp.statusText;
			throw new Error('The admin API answered ' + resp.status + ': ' + msg);
		}
		return body;
	}

	function showError(msg) {
		const box = byId('error');
		box.textContent = msg;
		box.hidden = !msg;
	}

	// record keeps the zone's refused total and returns the refusals per
	// second over the last poll.
	function record(zone, now, total) {
		const h = history.get(zone) || [];
		h.push({t: now, total: total});
		while (h.length > points + 1) h.shift();
		history.set(zone, h);
		if (h.length < 2) return 0;
		const a = h[h.length - 2], b = h[h.length - 1];
		return Math.max(0, (b.total - a.total) / Math.max((b.t - a.t) / 1000, 0.001));
	}

	function sparkline(zone) {
		const ns = 'http://www.w3.org/2000/svg';
		const svg = document.createElementNS(ns, 'svg');
		svg.setAttribute('class', 'spark');
		svg.setAttribute('viewBox', '0 0 160 28');
		const h = history.get(zone) || [];
		const rates = [];
		for (let i = 1; i < h.length; i++) rates.push(Math.max(0, (h[i].total - h[i - 1].total) / Math.max((h[i].t - h[i - 1].t) / 1000, 0.001)));
		const top = Math.max(1, ...rates);
		const base = document.createElementNS(ns, 'line');
		base.setAttribute('x1', '0'); base.setAttribute('x2', '160');
		base.setAttribute('y1', '27'); base.setAttribute('y2', '27');
		svg.append(base);
		if (rates.length > 1) {
			const step = 160 / (points - 1);
			const off = 160 - step * (rates.length - 1);
			const line = document.createElementNS(ns, 'polyline');
			line.setAttribute('points', rates.map((r, i) => (off + i * step).toFixed(1) + ',' + (27 - 25 * r / top).toFixed(1)).join(' '));
			svg.append(line);
		}
		const title = document.createElementNS(ns, 'title');
		title.textContent = 'peak ' + top.toFixed(1) + ' refused/s';
		svg.append(title);
		return svg;
	}

	// seconds writes a number of seconds as people write durations, as the
	// command line does: 1m, 15m, 1h30m, 1m30s, without zero parts.
	function seconds(s) {
		s = Math.max(0, Math.floor(s));
		if (s === 0) return '0s';
		const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), r = s % 60;
		return (h ? h + 'h' : '') + (m ? m + 'm' : '') + (r ? r + 's' : '');
	}

	// tracked shows a zone's tracked keys as the API gives them: a Redis
	// zone's count may be older than the poll (its age is shown), or
	// partial while no count has finished (a lower bound, never a bare 0).
	function tracked(z) {
		const cell = el('td', 'num');
		if (z.tracked_keys_partial) {
			cell.textContent = '\u2265 ' + z.tracked_keys;
			cell.title = 'No count of the zone\'s keys in Redis has finished yet: at least this many';
		} else if (z.tracked_keys_age_seconds) {
			cell.textContent = z.tracked_keys + ' (' + seconds(z.tracked_keys_age_seconds) + ' ago)';
		} else {
			cell.textContent = z.tracked_keys;
		}
		return cell;
	}

	// renderSpoofable says which zones clients choose their own key in
	// (spoofable_key), and the fix, above the zones.
	function renderSpoofable(zones) {
		const names = zones.filter((z) => z.spoofable_key).map((z) => z.name);
		const box = byId('spoofable');
		box.hidden = names.length === 0;
		box.textContent = names.length === 0 ? '' :
			(names.length === 1 ? 'Zone ' : 'Zones ') + names.join(', ') + ': clients behind a trusted proxy choose their own key. ' +
			'The server takes the leftmost X-Forwarded-For address, which the client writes, because trusted_proxies_strict is off. ' +
			'Set trusted_proxies_strict, and list every proxy in front of Caddy (a CDN and the load balancer both) in trusted_proxies.';
	}

	function renderZones(zones, now) {
		const body = byId('zones').tBodies[0];
		body.replaceChildren();
		byId('no-zones').hidden = zones.length > 0;
		renderSpoofable(zones);
		for (const z of zones) {
			const perSec = record(z.name, now, z.rejected_total);
			const pick = el('button', 'zone', z.name);
			pick.type = 'button';
			pick.addEventListener('click', () => { selected = z.name; location.hash = 'zone=' + encodeURIComponent(z.name); refresh(); });
			const spoofable = z.spoofable_key ? el('span', 'tag-bad', 'spoofable key') : '';
			if (spoofable) spoofable.title = 'Clients behind a trusted proxy choose their own key: see the warning above';
			const row = el('tr', z.name === selected ? 'selected' : '',
				el('td', '', pick, z.enabled ? '' : ' (disabled)', spoofable),
				el('td', '', z.store + (z.hashed_keys ? ', hashed keys' : '')),
				el('td', '', z.health || '—'),
				el('td', 'num', seconds(z.window_seconds)),
				el('td', 'num', (z.policies || []).map((p) => p.max + '/' + seconds(p.window_seconds)).join(', ') || z.max),
				tracked(z),
				el('td', 'num', perSec.toFixed(1)),
				el('td', '', sparkline(z.name)),
				el('td', 'num', z.rejected_total),
				el('td', 'num', z.websocket_connections));
			row.dataset.zone = z.name;
			body.append(row);
		}
	}

	function renderKeys(list) {
		byId('offenders').hidden = false;
		byId('zone-name').textContent = list.zone;
		const body = byId('keys').tBodies[0];
		body.replaceChildren();
		countdowns.length = 0;
		const now = Date.now() / 1000;
		for (const k of list.keys) {
			const reset = el('td', 'num');
			// A key only among the recent offenders has no window (reset
			// 0): no live count to show. A banned key is refused until
			// its ban ends.
			const live = k.reset > 0 || k.banned_until > 0;
			if (live) countdowns.push({cell: reset, reset: Math.max(k.reset, k.banned_until || 0)});
			else reset.textContent = '—';
			const unblock = el('button', 'unblock', 'Unblock');
			unblock.type = 'button';
			unblock.addEventListener('click', () => forget(list.zone, k.key, unblock));
			unblock.title = 'Forget this key in every limit of the zone';
			const override = el('button', 'override', 'Override');
			override.type = 'button';
			override.addEventListener('click', () => { byId('override-key').value = k.key; byId('override-plan').focus(); });
			override.title = 'Give this key a plan or a max of its own (the form below)';
			const row = el('tr', k.limited ? 'limited' : '',
				el('td', 'key', k.key),
				el('td', '', k.policy || ''),
				el('td', 'num', live ? k.count : '—'),
				el('td', 'num', live ? k.refused : '—'),
				el('td', 'num', live ? k.remaining : '—'),
				reset,
				el('td', '', k.banned_until ? 'banned' : k.limited ? 'yes' : 'no'),
				el('td', 'num', k.recent_refusals || '—'),
				el('td', 'num', k.last_refused ? seconds(now - k.last_refused) + ' ago' : '—'),
				el('td', 'num', k.in_flight || '—'),
				el('td', '', unblock, ' ', override));
			row.dataset.key = k.key;
			body.append(row);
		}
		tick();
		const recent = order === 'recent_refusals' ? ' refused in the last 5m' : '';
		byId('keys-summary').textContent = (list.keys.length === list.total
			? list.total + (list.total === 1 ? ' key' : ' keys')
			: (recent ? 'the most refused ' : 'the busiest ') + list.keys.length + ' of ' + list.total + ' keys') + recent;
	}

	// values writes an override's values as the command line does:
	// "max=9 hourly=off", or "—" for none.
	function values(o) {
		const parts = [];
		const add = (name, v) => {
			if (v.off) parts.push(name + '=off');
			else if (v.max) parts.push(name + '=' + v.max);
			if (v.burst) parts.push(name + '.burst=' + v.burst);
		};
		add('max', o);
		for (const name of Object.keys(o.limits || {}).sort()) add(name, o.limits[name]);
		return parts.join(' ') || '—';
	}

	function renderOverrides(list) {
		byId('overrides').hidden = false;
		byId('overrides-zone').textContent = list.zone;
		const body = byId('override-list').tBodies[0];
		body.replaceChildren();
		const now = Date.now() / 1000;
		for (const o of list.overrides) {
			const key = o.key || o.key_hash;
			const remove = el('button', 'remove', 'Remove');
			remove.type = 'button';
			remove.addEventListener('click', () => unset(list.zone, o.key ? {key: o.key} : {key_hash: o.key_hash}, remove));
			remove.title = 'Remove the override: the key runs with its plan again';
			const row = el('tr', '',
				el('td', 'key', o.key || 'hash ' + o.key_hash),
				el('td', '', o.plan || '—'),
				el('td', '', values(o)),
				el('td', 'num', o.expires ? seconds(o.expires - now) : 'never'),
				el('td', '', remove));
			row.dataset.key = key;
			body.append(row);
		}
		byId('overrides-summary').textContent = list.overrides.length + ' of at most ' + list.max + ' overrides';
	}

	function overridesURL(zone) {
		return api + encodeURIComponent(zone) + '/overrides';
	}

	async function setOverride(e) {
		e.preventDefault();
		const o = {key: byId('override-key').value.trim()};
		const plan = byId('override-plan').value.trim(), max = byId('override-max').value, ttl = byId('override-ttl').value.trim();
		if (plan) o.plan = plan;
		if (max) o.max = Number(max);
		if (ttl) o.ttl = ttl;
		try {
			await call(overridesURL(selected), {method: 'PUT', body: JSON.stringify(o), headers: {Accept: 'application/json', 'Content-Type': 'application/json'}});
			byId('override-form').reset();
			await refresh();
		} catch (err) {
			showError(err.message);
		}
	}

	async function unset(zone, which, button) {
		button.disabled = true;
		try {
			await call(overridesURL(zone) + '?' + new URLSearchParams(which), {method: 'DELETE'});
			await refresh();
		} catch (e) {
			showError(e.message);
			button.disabled = false;
		}
	}

	function tick() {
		const now = Date.now() / 1000;
		for (const c of countdowns) c.cell.textContent = seconds(Math.max(0, Math.floor(c.reset - now)));
	}

	async function forget(zone, key, button) {
		button.disabled = true;
		try {
			await call(api + encodeURIComponent(zone) + '?' + new URLSearchParams({key: key}), {method: 'DELETE'});
			await refresh();
		} catch (e) {
			showError(e.message);
			button.disabled = false;
		}
	}

	async function refresh() {
		if (busy) return;
		busy = true;
		try {
			const zones = await call(api);
			if (!zones.some((z) => z.name === selected)) selected = zones.length ? zones[0].name : '';
			renderZones(zones, Date.now());
			if (selected) {
				const q = new URLSearchParams({limit: '50', sort: order});
				if (prefix) q.set('q', prefix);
				if (limitedOnly) q.set('limited', 'true');
				renderKeys(await call(api + encodeURIComponent(selected) + '?' + q));
				renderOverrides(await call(overridesURL(selected)));
			} else {
				byId('offenders').hidden = true;
				byId('overrides').hidden = true;
			}
			showError('');
			byId('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
		} catch (e) {
			showError(e.message);
		} finally {
			busy = false;
		}
	}

	byId('filter').addEventListener('submit', (e) => e.preventDefault());
	byId('override-form').addEventListener('submit', setOverride);
	byId('prefix').addEventListener('input', (e) => { prefix = e.target.value; refresh(); });
	byId('limited').addEventListener('change', (e) => { limitedOnly = e.target.checked; refresh(); });
	byId('order').addEventListener('change', (e) => { order = e.target.value; refresh(); });
	setInterval(refresh, pollMs);
	setInterval(tick, 1000);
	refresh();
})();
