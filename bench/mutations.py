#!/usr/bin/env python
"""Proof that the tests bite: break each promise of the README on purpose,
one at a time, and run the tests that pin it; every one must fail, on an
assertion (a mutation that only makes a fixture or a worker crash is not
counted as caught: the crash could have another cause).

Each mutation replaces one piece of text in a copy of the repository (the
committed tree, in a temporary folder) and runs the named tests there.
Prints JSON: for each mutation, the promise, the tests run and whether they
failed (``caught``). docs/testing.md lists the same promises.

    python bench/mutations.py [--only NAME ...] [--out FILE]

About 15 minutes for all on 2 cores, the control run (the same tests on
the unchanged tree, which must pass) included.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from output import emit  # noqa: E402

# name: (promise, file, text, replacement, tests)
MUTATIONS = {
    "scale-without-world-size": (
        "gradients are multiplied by W/N: the large-batch gradient",
        "hetseq/controller.py",
        "self._grad_divisor = ctx.world_size if ctx.distributed and not self.local else 1",
        "self._grad_divisor = 1",
        ["tests/test_parity.py::test_two_uneven_ranks_match_one_process"]),
    "scale-rounded-to-float32": (
        "the scale is applied in the gradients' precision (W/N = 3/36 is no binary fraction)",
        "hetseq/controller.py",
        "wide = [g for g in grads if g.dtype == torch.float64]",
        "wide = []",
        ["tests/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process"]),
    "padding-batch-counts": (
        "a rank whose slice is empty takes part with zero weight",
        "hetseq/controller.py",
        "weight=0.0 if sample is None else 1.0",
        "weight=1.0",
        ["tests/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process"]),
    "sync-every-micro-batch": (
        "local accumulation (micro-batches, --update-freq) adds no communication",
        "hetseq/sharding.py",
        "return wrapped.no_sync()",
        "return contextlib.nullcontext()",
        ["tests/test_communication.py"]),
    "update-freq-ignored": (
        "--update-freq K accumulates K global batches per update",
        "hetseq/train.py",
        "for chunk in _chunks(data.next_epoch_itr(), update_freq):",
        "for chunk in _chunks(data.next_epoch_itr(), 1):",
        ["tests/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process",
         "tests/test_communication.py"]),
    "stats-after-backward": (
        "the stats all-reduce starts before the last backward and runs during it",
        "hetseq/stats.py",
        "            if self.announced:\n                self.stats.start()\n",
        "",
        ["tests/test_parity.py::test_stats_travel_in_one_all_reduce_started_before_backward"]),
    "norm-only-when-shown": (
        "a node's own flags never change the collectives (the sharded norm always rides "
        "with the overflow flag)",
        "hetseq/controller.py",
        "        if self.sharding.shards_grads:\n            norm, finite = "
        "self._sharded_norm_and_scale(grads, scale, clip)",
        "        if self.sharding.shards_grads and clip == 0:\n"
        "            finite = not self.sharding.reduce(_scale_and_check(grads, scale, "
        "self.ctx.device)).item()\n"
        "            norm = lambda: math.sqrt(self.sharding.reduce(_squares(grads, "
        "self.ctx.device)).item())\n"
        "        elif self.sharding.shards_grads:\n            norm, finite = "
        "self._sharded_norm_and_scale(grads, scale, clip)",
        ["tests/test_per_node_flags.py::test_every_rank_takes_the_same_update_path"]),
    "zero1-not-sharded": (
        "--zero 1 splits the optimizer state",
        "hetseq/sharding.py",
        "        if not self.ctx.distributed:\n            return optimizer\n"
        "        from torch.distributed.optim import ZeroRedundancyOptimizer",
        "        return optimizer\n        from torch.distributed.optim import "
        "ZeroRedundancyOptimizer",
        ["tests/test_sharding.py::test_each_mode_holds_exactly_its_share_of_the_model_state"]),
    "loss-scale-not-divided-out": (
        "the fp16 loss scale is divided out exactly",
        "hetseq/controller.py",
        "scale = self._grad_divisor / (sample_size * (self.scaler.scale if self.scaler else 1.0))",
        "scale = self._grad_divisor / sample_size",
        ["tests/test_precision.py::test_fp16_loss_scaling_is_exact"]),
    "overflow-flag-not-summed": (
        "an overflow in any shard skips the update on every rank",
        "hetseq/controller.py",
        "return norm, math.isfinite(norm) and not summed[1]",
        "return norm, not found.item()",
        ["tests/test_checkpoint.py::test_overflow_in_one_shard_skips_on_every_rank"]),
    "reduce-dtype-ignored": (
        "--reduce-dtype bfloat16 sums gradients in 16 bits",
        "hetseq/precision.py",
        "    if cfg.reduce_dtype == \"float32\":\n        return None\n    dtype = DTYPES",
        "    return None\n    dtype = DTYPES",
        ["tests/test_precision.py::test_gradients_summed_in_bfloat16_when_asked"]),
    "dropout-drawn-per-rank": (
        "dropout masks are drawn per sample, not from each rank's generator",
        "hetseq/randomness.py",
        """    if not active():
        return F.dropout(x, p, training=True)""",
        """    if True:
        return F.dropout(x, p, training=True)""",
        ["tests/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process",
         "tests/test_parity.py::test_two_uneven_ranks_match_one_process",
         "tests/test_checkpoint.py::test_resume_on_another_world_size_is_exact_with_dropout"]),
    "attention-dropout-drawn-per-rank": (
        "BERT's attention-probability dropout is drawn per sample too",
        "hetseq/bert/model.py",
        "        if p > 0 and randomness.active():",
        "        if False:",
        ["tests/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process"]),
    "draws-keyed-by-batch-position": (
        "a sample's key is made from its index in the dataset, not its place in the batch",
        "hetseq/data/iterators.py",
        "sample_keys(self.batches.seed, self.epoch, part)",
        "sample_keys(self.batches.seed, self.epoch, range(len(part)))",
        ["tests/test_global_batches.py::test_each_micro_batch_carries_the_keys_of_its_own_samples",
         "tests/test_parity.py::test_two_uneven_ranks_match_one_process"]),
    "draws-depend-on-padding": (
        "a position's draw does not depend on the length a sequence is padded to",
        "hetseq/randomness.py",
        "words = _absorb_(words.unsqueeze(-1).expand(*words.shape, size).clone(), index)",
        "words = _absorb_(words.unsqueeze(-1).expand(*words.shape, size).clone(), index + size)",
        ["tests/test_randomness.py::test_a_samples_mask_does_not_depend_on_its_batch_or_its_padding",
         "tests/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process"]),
    "draws-ignore-the-epoch": (
        "each epoch draws new masks for a sample",
        "hetseq/randomness.py",
        "    for word in (seed % WORD, seed // WORD % WORD, epoch % WORD):",
        "    for word in (seed % WORD, seed // WORD % WORD):",
        ["tests/test_randomness.py::test_the_hash_on_tensors_equals_the_hash_on_python_integers",
         "tests/test_randomness.py::test_every_key_part_changes_the_draw"]),
    "checkpoint-unpickles-code": (
        "a checkpoint carrying pickled code is refused and the code never runs",
        "hetseq/checkpoint.py",
        'state = torch.load(path, map_location="cpu", weights_only=True)',
        'state = torch.load(path, map_location="cpu", weights_only=False)',
        ["tests/test_untrusted.py::test_a_checkpoint_carrying_code_is_refused_and_the_code_never_runs"]),
    "peer-payload-unpickles-code": (
        "a collective's payload carrying pickled code is refused and the code never runs",
        "hetseq/distributed/collectives.py",
        "                      weights_only=True)",
        "                      weights_only=False)",
        ["tests/test_untrusted.py::test_a_payload_from_a_peer_carrying_code_is_refused_and_the_code_never_runs"]),
    "data-position-lost": (
        "the data position is kept in samples: the epoch goes on from the saved sample",
        "hetseq/data/iterators.py",
        "        self.samples_in_epoch = state.get(\"samples_in_epoch\")",
        "        self.samples_in_epoch = 0",
        ["tests/test_checkpoint.py::test_resume_with_another_global_batch_uses_every_sample_once"]),
    "reset-flags-ignored": (
        "--reset-optimizer/-dataloader/-meters leave that state out of a resume",
        "hetseq/train.py",
        '    skip = {"plan"} if elastic else set()\n',
        '    skip = {"plan"} if elastic else set()\n    return skip\n',
        ["tests/test_checkpoint.py::test_reset_flags_keep_the_model_only"]),
    "meters-reset-on-resume": (
        "a resumed epoch's running averages go on",
        "hetseq/logging/report.py",
        "        if not resumed:\n            self.meters.reset()",
        "        self.meters.reset()",
        ["tests/test_checkpoint.py::test_reset_flags_keep_the_model_only"]),
    "write-in-place": (
        "a crash while saving keeps the previous checkpoint (atomic rename)",
        "hetseq/checkpoint.py",
        "    fd, tmp = tempfile.mkstemp(prefix=\".tmp-\", suffix=\".pt\", dir=folder)",
        "    fd, tmp = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), dst",
        ["tests/test_checkpoint.py::test_kill_while_saving_keeps_the_previous_checkpoint"]),
    "no-agreement-check": (
        "ranks that drift apart are brought back, ranks that diverge stop the run",
        "hetseq/agreement.py",
        "        if disagreeing(checksums):\n",
        "        if False:\n",
        ["tests/test_agreement.py"]),
    "stateless-optimizer-state": (
        "a stateless optimizer's checkpoint resumes under --zero 2/3",
        "hetseq/sharding.py",
        "        if not state[\"state\"]:\n",
        "        if False:\n",
        ["tests/test_sharding.py::test_resume_of_a_stateless_optimizer_under_another_mode_and_world"]),
    "slices-overlap": (
        "rank i takes a contiguous slice of each global batch; every sample once per epoch",
        "hetseq/data/iterators.py",
        "        start = sum(sizes[:rank])\n",
        "        start = 0\n",
        ["tests/test_global_batches.py::test_every_index_once_per_epoch_with_uneven_splits"]),
    "non-finite-applied": (
        "a NaN/inf loss or gradient skips the update on every rank",
        "hetseq/controller.py",
        "        if not finite:\n            if self.scaler is None:",
        "        if False:\n            if self.scaler is None:",
        ["tests/test_checkpoint.py::test_non_finite_gradient_on_one_rank_skips_on_all"]),
    "identity-not-compared": (
        "a node whose job flags differ is refused before it claims a rank",
        "hetseq/distributed/identity.py",
        "        held = store.get(\"hetseq/job\").decode()\n        if held == mine:\n",
        "        held = store.get(\"hetseq/job\").decode()\n        if True:\n",
        ["tests/test_job_identity.py::test_node_with_other_seed_and_epochs_is_refused_naming_both"]),
    "lost-rank-unnamed": (
        "the survivors of a lost rank stop with code 3 naming it and its host",
        "hetseq/distributed/health.py",
        "        lost = [r for r in silent if r != rank]\n",
        "        lost = []\n",
        ["tests/test_checkpoint.py::test_sigkill_of_one_rank_names_it"]),
    "stale-file-joined": (
        "a file:// meeting point left by a killed job is recognised and named",
        "hetseq/distributed/rendezvous.py",
        "    if not members:\n        return\n",
        "    return\n",
        ["tests/test_startup.py::test_file_left_by_a_killed_job_is_named"]),
    "elastic-state-from-rank-0": (
        "an elastic generation takes the state of the member with the most completed updates",
        "hetseq/distributed/generations.py",
        "return max(candidates, key=newness), refused",
        "return 0, refused",
        ["tests/test_elastic.py::test_the_state_comes_from_the_member_with_the_most_updates"]),
    "elastic-snapshot-skips-the-update-in-flight": (
        "survivors drop the update in flight: its samples are trained in the next generation",
        "hetseq/train.py",
        "if self.controller.num_updates != done:",
        "if True:",
        ["tests/test_elastic.py::test_a_frozen_host_is_left_behind"]),
    "elastic-join-signal-ignored": (
        "a node started later joins the running job at an update boundary",
        "hetseq/train.py",
        "self._reconfigure = any(result.signals)",
        "self._reconfigure = False",
        ["tests/test_elastic.py::test_a_lost_host_an_intruder_and_a_late_joiner"]),
    "elastic-rounds-without-quorum": (
        "a round closes only with a quorum of the previous generation: a split trains one side",
        "hetseq/distributed/generations.py",
        "return 2 * present > len(old) or (2 * present == len(old) and old[0] in arrived_ids)",
        "return True",
        ["tests/test_elastic.py::test_a_split_into_halves_trains_on_one_side_only"]),
    "elastic-paused-node-ignores-the-newer-generation": (
        "a node that wakes up after the job went on joins it instead of leading its own",
        "hetseq/distributed/elastic.py",
        'newer = [s for s in said if s is not None and s["generation"] > own]',
        "newer = []",
        ["tests/test_elastic.py::test_a_paused_meeting_point_rejoins_the_job_and_never_trains_alone"]),
    "elastic-max-nodes-cuts-in-arrival-order": (
        "--max-nodes orders first (the leader, old members), then cuts",
        "hetseq/distributed/generations.py",
        "return (lead + old + new)[:max_nodes or None]",
        "return [m for m in lead + old + new if m in arrived[:max_nodes or None]]",
        ["tests/test_elastic.py::test_ranks_are_ordered_before_max_nodes_cuts"]),
    "elastic-waiting-node-calls-meetings": (
        "a node without a place (--max-nodes) waits without calling a meeting each update",
        "hetseq/distributed/elastic.py",
        "            if self._full(store):\n",
        "            if False:\n",
        ["tests/test_elastic.py::test_max_nodes_keeps_its_leader_and_a_waiting_node_takes_a_freed_place"]),
    "elastic-lineage-ignored": (
        "a state that is not on the job's line is refused as the source",
        "hetseq/distributed/generations.py",
        "if line is not None and not on_line(members[r][\"lineage\"], line)]",
        "if False]",
        ["tests/test_elastic.py::test_a_state_from_another_lineage_is_refused"]),
    "elastic-received-state-not-checked": (
        "every rank refuses a source state whose lineage is not the one the round agreed on",
        "hetseq/checkpoint.py",
        "if lineage is not None and list(got) != list(lineage):",
        "if False:",
        ["tests/test_checkpoint.py::test_an_elastic_state_keeps_its_lineage_and_another_line_is_refused"]),
    "gate-handshakes-uncapped": (
        "a flood of idle connections holds at most HANDSHAKES sockets in rank 0",
        "hetseq/distributed/tunnel.py",
        "            if sum(self._busy.values()) < self.handshakes and \\\n",
        "            if True or \\\n",
        ["tests/test_gate.py::test_a_flood_of_idle_connections_neither_stops_the_job_nor_shuts_its_door"]),
    'gate-accept-error-fatal': (
        'a failed accept is waited out; only closing the listener ends the gate',
        'hetseq/distributed/tunnel.py',
        '            except OSError as err:\n                if listener.fileno() == -1:',
        '            except OSError as err:\n                if True:',
        ['tests/test_gate.py::test_failed_accepts_are_waited_out_and_only_a_close_ends_the_gate']),
    'gate-handshake-deadline-per-read': (
        "the gate's handshake deadline bounds the whole handshake",
        'hetseq/distributed/tunnel.py',
        'keys = handshake_as_server(sock, self.secret, time.monotonic() + HANDSHAKE_S)',
        'keys = (sock.settimeout(HANDSHAKE_S), handshake_as_server(sock, self.secret))[1]',
        ['tests/test_gate.py::test_a_handshake_that_trickles_is_dropped_at_its_deadline']),
    'gate-busy-not-retried': (
        "a client told 'busy' asks again until its patience ends",
        'hetseq/distributed/tunnel.py',
        '            if time.monotonic() + pause > give_up:',
        '            if True:',
        ['tests/test_gate.py::test_over_its_cap_the_gate_answers_busy_at_once_and_a_member_gets_its_turn']),
    "gate-over-cap-gets-a-thread": (
        "over the cap a connection is answered busy at once",
        "hetseq/distributed/tunnel.py",
        "            if sum(self._busy.values()) < self.handshakes and \\\n",
        "            if True or \\\n",
        ["tests/test_gate.py::test_over_its_cap_the_gate_answers_busy_at_once_and_a_member_gets_its_turn"]),
    'secret-bits-not-counted': (
        'a secret needs 128 bits by its alphabet',
        'hetseq/distributed/tunnel.py',
        '    bits = len(text) * (4 if set(text.lower()) <= HEX else 6)',
        '    bits = len(text) * 8',
        ['tests/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-words-accepted': (
        'a secret of lowercase words is refused',
        'hetseq/distributed/tunnel.py',
        '    if (text.isalpha() and text.islower()) or \\\n',
        '    if False and (text.isalpha() and text.islower()) or False and \\\n',
        ['tests/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-empty-means-none': (
        'HETSEQ_JOB_SECRET set but empty is an error',
        'hetseq/distributed/tunnel.py',
        '    elif SECRET_VARIABLE in env:',
        '    elif env.get(SECRET_VARIABLE, "").strip():',
        ['tests/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-file-follows-links': (
        'the secret file is not opened through a symbolic link',
        'hetseq/distributed/tunnel.py',
        'os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC',
        'os.O_RDONLY | os.O_CLOEXEC',
        ['tests/test_secret.py::test_the_secret_file_is_checked_on_what_was_opened']),
    'secret-file-stat-by-path': (
        "the secret file's mode is checked on the opened descriptor",
        'hetseq/distributed/tunnel.py',
        '        info = os.fstat(fd)',
        '        info = os.stat(path)',
        ['tests/test_secret.py::test_the_secret_file_is_checked_on_what_was_opened']),
    'hetseq-secret-file-not-private': (
        'hetseq-secret --file writes a new file of mode 600',
        'hetseq/secret.py',
        'os.O_CLOEXEC, 0o600)',
        'os.O_CLOEXEC, 0o666)',
        ['tests/test_secret.py::test_hetseq_secret_makes_accepted_secrets_and_private_files']),
    'meeting-port-taken-silently': (
        'a URL port held by another program is an error',
        'hetseq/distributed/rendezvous.py',
        '    raise UserError(_in_use(address, port))',
        '    return _listen(url, address, 0)',
        ['tests/test_gate.py::test_a_taken_port_is_an_error_unless_a_node_of_this_job_holds_it']),
    'meeting-port-no-second-node': (
        'a second node of the same job on one host takes another port',
        'hetseq/distributed/rendezvous.py',
        '    if _holds_this_job(address, port, secret):',
        '    if False:',
        ['tests/test_gate.py::test_a_taken_port_is_an_error_unless_a_node_of_this_job_holds_it']),
    'meeting-point-ipv4-only': (
        "an IPv6 member serves the URL's port",
        'hetseq/distributed/rendezvous.py',
        '    family = socket.AF_INET6 if ":" in address else socket.AF_INET',
        '    family = socket.AF_INET',
        ['tests/test_gate.py::test_an_elastic_member_serves_an_ipv6_address_at_the_urls_port']),
    "store-on-every-address": (
        "a store never listens on every address; this host's ranks meet rank 0 where it listens",
        "hetseq/distributed/rendezvous.py",
        "    return interfaces.primary_address()\n",
        '    return "::" if socket.has_dualstack_ipv6() else "0.0.0.0"\n',
        ["tests/test_gate.py::test_a_store_never_listens_on_every_address"]),
    'collective-sizes-unbounded': (
        'sizes announced by peers are bounded (0..MAX_OBJECT_BYTES)',
        'hetseq/distributed/collectives.py',
        '    if not 0 <= size <= MAX_OBJECT_BYTES:',
        '    if size > MAX_OBJECT_BYTES:',
        ['tests/test_gate.py::test_sizes_announced_by_peers_are_bounded_before_anything_is_allocated']),
    'store-server-wait-ignores-departure': (
        'a waiting server thread ends when its client leaves',
        'hetseq/distributed/store.py',
        'execute(table, op, args, lambda: _client_gone(sock))',
        'execute(table, op, args, None)',
        ['tests/test_store.py::test_a_waiting_server_thread_ends_when_its_client_leaves']),
    'store-message-bound': (
        'a message over MAX_MESSAGE is refused from its header',
        'hetseq/distributed/store_wire.py',
        '    if total > MAX_MESSAGE:',
        '    if False:',
        ['tests/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-key-bound': (
        'keys over MAX_KEY close the connection',
        'hetseq/distributed/store_wire.py',
        'return self.blob(MAX_KEY, "key")',
        'return self.blob(MAX_VALUE, "key")',
        ['tests/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-unknown-op-answered': (
        'an unknown op closes the connection',
        'hetseq/distributed/store.py',
        '        raise Malformed(f"unknown op {request[0] if request else None}")',
        '        return bytes([INVALID]) + blob(b"unknown op")',
        ['tests/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-no-socket-bound': (
        'a call on a server that never answers ends after the store timeout',
        'hetseq/distributed/store.py',
        '    seconds = 0 if seconds is None else max(seconds, 0.001)',
        '    seconds = 0',
        ['tests/test_store.py::test_a_frozen_server_does_not_hang_a_call']),
    'store-client-timeout-ignored': (
        "get/wait honour the store's timeout with DistStoreError",
        'hetseq/distributed/store.py',
        '        seconds = _seconds(self.timeout if timeout is None else _delta(timeout))',
        '        seconds = None',
        ['tests/test_store.py::test_get_and_wait_time_out_with_dist_store_error']),
    'store-lost-connection-type': (
        'a lost connection raises DistNetworkError',
        'hetseq/distributed/store.py',
        '            self._lose(str(err) or type(err).__name__)\n            raise dist.DistNetworkError(',
        '            self._lose(str(err) or type(err).__name__)\n            raise ConnectionError(',
        ['tests/test_store.py::test_a_server_that_goes_away_ends_a_blocked_call']),
    'store-loopback-tcpstore': (
        'no unauthenticated listener: another uid cannot read a key',
        'hetseq/distributed/store.py',
        '    store = LocalStore(Table(), timeout)\n    store.gate = tunnel.Gate(listener, secret_key, serve_connection(store.table))',
        '    store = dist.TCPStore("127.0.0.1", 0, None, True, _delta(timeout), wait_for_workers=False)\n    tunnel.Gate(listener, secret_key, serve_connection(Table()))',
        ['tests/test_store.py::test_another_uid_cannot_reach_the_store_without_the_handshake']),
    "elastic-rounds-of-one-generation-stay-apart": (
        "two rounds of one generation meet at the lower-ranked leader",
        "hetseq/distributed/rounds.py",
        "        target = newer or self._lower_round(live, previous)\n",
        "        target = newer\n",
        ["tests/test_elastic.py::test_two_rounds_of_one_generation_meet_at_the_lower_ranked_leader"]),
    "elastic-non-leader-hides-where-it-meets": (
        "a node that met at a member which is not leading follows that member to its round",
        "hetseq/distributed/elastic.py",
        '            if store.check([f"e/{number}/at"]):      # not the leader: it meets elsewhere\n',
        "            if False:\n",
        ["tests/test_elastic.py::test_two_rounds_of_one_generation_meet_at_the_lower_ranked_leader"]),
    "gate-no-cap-per-address": (
        "one address cannot take every place in the gate's handshakes",
        "hetseq/distributed/tunnel.py",
        "                    self._busy.get(source, 0) < self.per_source:",
        "                    True:",
        ["tests/test_gate.py::test_one_address_cannot_take_every_place_in_the_handshake"]),
    "store-answer-built-before-measured": (
        "a small request cannot make the store build a huge answer",
        "hetseq/distributed/store.py",
        "    if op == MULTI_GET and sum(len(value) + 4 for value in result) > MAX_MESSAGE:",
        "    if False:",
        ["tests/test_store.py::test_a_small_request_cannot_make_the_server_build_a_huge_answer"]),
    "secret-typed-shapes-accepted": (
        "secrets with the shapes of typed text are refused",
        "hetseq/distributed/tunnel.py",
        '    if not set(text) <= GENERATED:\n',
        '    if False:\n',
        ["tests/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one"]),
    "torchrun-restart-sees-old-claims": (
        "a job under torchrun --max-restarts resumes after a restart",
        "hetseq/distributed/rendezvous.py",
        'restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")',
        "restart = None",
        ["tests/test_launchers.py::test_torchrun_restart_resumes_from_the_checkpoint_exactly"]),
    "local-steps-ranks-weighted-equally": (
        "--local-steps: a round's changes are weighted by the samples each rank processed",
        "hetseq/controller.py",
        "local.exchange(samples / summed if summed > 0 else 0.0, settle=boundary)",
        "local.exchange(1.0 / self.ctx.world_size, settle=boundary)",
        ["tests/test_local_steps.py::test_exact_where_the_mathematics_says_so"]),
    "local-steps-inner-gradient-averaged-over-ranks": (
        "--local-steps: an inner step follows the gradient of the rank's own mean loss",
        "hetseq/controller.py",
        "self._grad_divisor = ctx.world_size if ctx.distributed and not self.local else 1",
        "self._grad_divisor = ctx.world_size if ctx.distributed else 1",
        ["tests/test_local_steps.py::test_exact_where_the_mathematics_says_so"]),
    "outer-overlap-drops-the-own-change": (
        "--outer-overlap: a rank keeps its own change until the round's average lands",
        "hetseq/local_steps.py",
        "self.flat.write([g - d for g, d in zip(self.anchor, change)])",
        "self.flat.write(self.anchor)",
        ["tests/test_local_steps.py::test_overlap_alone_follows_the_local_trajectory"]),
    "save-inside-a-round": (
        "--local-steps: a save ends the round, so a resume is exact",
        "hetseq/train.py",
        "or bool(max_update and done >= max_update) or bool(every and done % every == 0))",
        "or bool(max_update and done >= max_update))",
        ["tests/test_local_steps.py::test_resume_mid_round_is_exact_and_keeps_every_ranks_optimizer"]),
    "powersgd-hook-not-registered": (
        "--grad-compression powersgd compresses the gradient all-reduce",
        "hetseq/sharding.py",
        "ddp.register_comm_hook(*powersgd_hook(exchange))",
        "pass",
        ["tests/test_local_steps.py::test_compressed_exchanges_stay_near_the_exact_one"]),
    "optimizer-mismatch-not-detected": (
        "a checkpoint of another optimizer is refused before training, in one line",
        "hetseq/controller.py",
        "            _check_same_optimizer(own, *self._optimizer_kind)\n",
        "",
        ["tests/test_bad_inputs.py::test_bad_input_gives_one_clear_message"]),
    "compile-compiles-nothing": (
        "--compile compiles the model's forward",
        "hetseq/controller.py",
        "self.model.forward = torch.compile(self.model.forward)",
        "self.model.forward = self.model.forward",
        ["tests/test_parity.py::test_compile_traces_the_forward_and_keeps_the_parameter_names"]),
    "node-lines-from-rank-0-only": (
        "every node prints when it joins and ends, not only rank 0's",
        "hetseq/distributed/launch.py",
        "setup_logging(rank, all_ranks=node.log.log_all_ranks, node_first=index == 0)",
        "setup_logging(rank, all_ranks=node.log.log_all_ranks)",
        ["tests/test_first_hour.py::test_two_nodes_print_progress_rates_and_their_own_lines"]),
    "lr-line-claims-the-planned-horizon": (
        "the LR-schedule line states the horizon actually used",
        "hetseq/optim/lr_scheduler.py",
        'source = "--total-num-update" if self.cfg.total_num_update else "the planned run"',
        'source = "the planned run"',
        ["tests/test_first_hour.py::test_two_nodes_print_progress_rates_and_their_own_lines"]),
}


def applies(path, text, root=ROOT):
    """Whether ``text`` occurs exactly once in ``path`` (a mutation that no
    longer applies would prove nothing)."""
    with open(os.path.join(root, path)) as f:
        return f.read().count(text) == 1


def verdict(junit_xml, tests):
    """(caught, why) from pytest's JUnit XML: caught only when one of the
    named tests FAILED on an assertion (an assert, pytest.raises or
    pytest.fail), not when a fixture, a worker or the collection errored."""
    import xml.etree.ElementTree as ET
    named = {(t.split("::", 1)[0], t.split("::", 1)[1].split("[", 1)[0])
             for t in tests if "::" in t}
    files = {t for t in tests if "::" not in t}
    why = []
    for case in ET.parse(junit_xml).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            continue
        name = case.get("name", "").split("[", 1)[0]
        module = case.get("classname", "").replace(".", "/") + ".py"
        message = failure.get("message", "")
        asserted = message.startswith(("assert", "AssertionError", "Failed", "Failed:")) or \
            "DID NOT RAISE" in message or failure.text and "AssertionError" in failure.text
        if asserted and ((module, name) in named or module in files):
            why.append(f"{case.get('name')}: {message.splitlines()[0][:200] if message else ''}")
    return bool(why), why[:2]


def run(name, promise, path, text, replacement, tests):
    """Runs ``tests`` in a copy of HEAD where ``text`` in ``path`` reads ``replacement``
    (``path`` None: the copy unchanged, the control run)."""
    with tempfile.TemporaryDirectory() as copy:
        archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", copy], input=archive, check=True)
        if path is not None:
            if not applies(path, text, copy):
                return {"name": name, "promise": promise, "error": f"text not found once in {path}"}
            target = os.path.join(copy, path)
            with open(target) as f:
                source = f.read()
            with open(target, "w") as f:
                f.write(source.replace(text, replacement))
        start = time.time()
        junit = os.path.join(copy, "junit.xml")
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", *tests], cwd=copy, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": copy}, timeout=1800)
        lines = done.stdout.strip().splitlines() or [""]
        caught, why = verdict(junit, tests) if os.path.exists(junit) else (False, [])
        return {"name": name, "promise": promise, "file": path, "tests": tests,
                "caught": caught, "returncode": done.returncode, "pytest": lines[-1], "why": why,
                "seconds": round(time.time() - start, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names (default: all)")
    parser.add_argument("--out")
    opts = parser.parse_args()
    names = opts.only or list(MUTATIONS)
    # The control: the same tests on the unchanged tree must pass, or a failure
    # under a mutation proves nothing.
    tests = sorted({t for name in names for t in MUTATIONS[name][4]})
    control = run("control", "the unchanged tree passes the same tests", None, None, None, tests)
    results = [run(name, *MUTATIONS[name]) for name in names]
    emit({"control_passed": control["returncode"] == 0, "control": control, "mutations": results,
          "caught": sum(bool(r.get("caught")) for r in results), "of": len(results)}, opts.out)


if __name__ == "__main__":
    main()
