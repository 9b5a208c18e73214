"""The promises bench/mutations.py breaks, one mutation each (docs/testing.md
lists the same promises)."""

# name: (promise, text, replacement, tests). The text is found where it
# occurs, once in all of hetseq/ (bench/mutations.py's locate): moving code
# between modules or renaming a module leaves every mutation applying.
MUTATIONS = {
    "scale-without-world-size": (
        "gradients are multiplied by W/N: the large-batch gradient",
        "self.divisor = ctx.world_size if ctx.distributed else 1",
        "self.divisor = 1",
        ["tests/system/test_parity.py::test_two_uneven_ranks_match_one_process"]),
    "scale-rounded-to-float32": (
        "the scale is applied in the gradients' precision (W/N = 3/36 is no binary fraction)",
        "wide = [g for g in grads if g.dtype == torch.float64]",
        "wide = []",
        ["tests/system/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process"]),
    "padding-batch-counts": (
        "a rank whose slice is empty takes part with zero weight",
        "weight=0.0 if sample is None else 1.0",
        "weight=1.0",
        ["tests/system/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process"]),
    "idle-rank-runs-forward": (
        "a rank without samples computes nothing where its mode can take part in the "
        "exchange without a forward (DDP, local steps)",
        "        if samples == [None] and self._wrapper_ran and self.sharding.can_idle():",
        "        if False:",
        ["tests/system/test_parity.py::"
         "test_a_rank_without_samples_computes_nothing_and_the_update_stays_exact"]),
    "sitting-rank-computes": (
        "a rank that sits out runs no forward and joins no gradient exchange",
        "            return self._sit_out(stats, boundary)",
        "            self.task.train_step(self.model, self._keyed(dummy)[0])\n"
        "            return self._sit_out(stats, boundary)",
        ["tests/system/test_sitting.py::test_a_rank_with_weight_zero_sits_out_and_the_update_stays_exact"]),
    "members-divisor-stays-the-world": (
        "without the ranks that sit out, W is the members' count",
        "self.exchange.divisor = len(self.members.active)",
        "self.exchange.divisor = self.ctx.world_size",
        ["tests/system/test_sitting.py::test_a_rank_with_weight_zero_sits_out_and_the_update_stays_exact"]),
    "returning-rank-keeps-its-state": (
        "a rank that comes back takes rank 0's whole state (optimizer included)",
        "                if self.ctx.rank in returning:\n                    self.load_state_dict(state)",
        "                pass",
        ["tests/system/test_sitting.py::"
         "test_a_slow_rank_sits_out_then_comes_back_and_the_job_matches_one_process"]),
    "round-waits-to-settle-at-its-deadline": (
        "at --distributed-timeout a round with enough nodes and a quorum closes with them",
        "                if enough:      # the last arrival had no time to settle: close with "
        "whoever came\n                    break\n",
        "",
        ["tests/system/test_elastic.py::test_a_round_closes_at_its_deadline_with_whoever_came"]),
    "rename-not-made-durable": (
        "a save is durable: the file's data before the rename, its folder after it",
        "        os.replace(tmp, dst)\n        _sync_folder(folder)\n",
        "        os.replace(tmp, dst)\n",
        ["tests/unit/run/test_checkpoint.py::test_a_save_reaches_the_disk_file_first_then_its_folder"]),
    "every-refusal-logged": (
        "refused handshakes are one line per source and interval, not one each",
        "        first, due = self._refusals.add(source, str(why))\n",
        "        first, due = True, []\n",
        ["tests/unit/store/test_gate.py::test_refused_handshakes_are_one_line_per_source_and_interval"]),
    "sync-every-micro-batch": (
        "local accumulation (micro-batches, --update-freq) adds no communication",
        "return wrapped.no_sync()",
        "return contextlib.nullcontext()",
        ["tests/system/test_communication.py"]),
    "update-freq-ignored": (
        "--update-freq K accumulates K global batches per update",
        "for chunk in _chunks(data.next_epoch_itr(), update_freq):",
        "for chunk in _chunks(data.next_epoch_itr(), 1):",
        ["tests/system/test_parity.py::test_three_uneven_ranks_with_accumulation_match_one_process",
         "tests/system/test_communication.py"]),
    "stats-after-backward": (
        "the stats all-reduce starts before the last backward and runs during it",
        "            if micro.announced:\n                micro.stats.start()\n",
        "",
        ["tests/system/test_parity.py::test_stats_travel_in_one_all_reduce_started_before_backward"]),
    "norm-only-when-shown": (
        "a node's own flags never change the collectives (the sharded norm always rides "
        "with the overflow flag)",
        "        norm, finite = self._sharded_norm_and_scale(grads, scale, clip)\n",
        "        if clip == 0:\n"
        "            finite = not self.sharding.reduce(scale_and_check(grads, scale, "
        "self.ctx.device)).item()\n"
        "            norm = lambda: math.sqrt(self.sharding.reduce(squares(grads, "
        "self.ctx.device)).item())\n"
        "        else:\n"
        "            norm, finite = self._sharded_norm_and_scale(grads, scale, clip)\n",
        ["tests/system/test_per_node_flags.py::test_every_rank_takes_the_same_update_path"]),
    "zero1-not-sharded": (
        "--zero 1 splits the optimizer state",
        "        if not self.ctx.distributed:\n            return optimizer\n"
        "        from torch.distributed.optim import ZeroRedundancyOptimizer",
        "        return optimizer\n        from torch.distributed.optim import "
        "ZeroRedundancyOptimizer",
        ["tests/system/test_sharding.py::test_each_mode_holds_exactly_its_share_of_the_model_state"]),
    "loss-scale-not-divided-out": (
        "the fp16 loss scale is divided out exactly",
        "scale = self.exchange.divisor / (sample_size * (self.scaler.scale if self.scaler else 1.0))",
        "scale = self.exchange.divisor / sample_size",
        ["tests/system/test_precision.py::test_fp16_loss_scaling_is_exact"]),
    "overflow-flag-not-summed": (
        "an overflow in any shard skips the update on every rank",
        "return norm, math.isfinite(norm) and not summed[1]",
        "return norm, not found.item()",
        ["tests/system/test_checkpoint.py::test_overflow_in_one_shard_skips_on_every_rank"]),
    "reduce-dtype-ignored": (
        "--reduce-dtype bfloat16 sums gradients in 16 bits",
        "    if cfg.reduce_dtype == \"float32\":\n        return None\n    dtype = DTYPES",
        "    return None\n    dtype = DTYPES",
        ["tests/system/test_precision.py::test_gradients_summed_in_bfloat16_when_asked"]),
    "dropout-drawn-per-rank": (
        "dropout masks are drawn per sample, not from each rank's generator",
        """    if not active():
        return F.dropout(x, p, training=True)""",
        """    if True:
        return F.dropout(x, p, training=True)""",
        ["tests/system/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process",
         "tests/system/test_parity.py::test_two_uneven_ranks_match_one_process",
         "tests/system/test_checkpoint.py::test_resume_on_another_world_size_is_exact_with_dropout"]),
    "attention-dropout-drawn-per-rank": (
        "BERT's attention-probability dropout is drawn per sample too",
        "    if not (p > 0 and randomness.active()):",
        "    if True:",
        ["tests/system/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process"]),
    "kernel-draws-per-slot": (
        "the attention draw takes each sample's masks from its own key, not its slot in the batch",
        "    key = tl.load(KEYS + plane // heads, mask=live, other=0)",
        "    key = (plane // heads).to(tl.int32)",
        ["tests/unit/keyed/test_kernels.py::test_a_samples_attention_mask_is_its_own_wherever_it_sits",
         "tests/unit/keyed/test_kernels.py::test_the_attention_kernel_drops_the_masks_of_randomness_bit_for_bit",
         "tests/system/test_randomness.py::"
         "test_dropout_models_split_over_ranks_through_the_kernels_match_one_process"]),
    "dropout-kernel-draws-per-slot": (
        "the dropout kernel draws each sample's mask from its own key, not its slot in the batch",
        "tl.load(KEYS + plane // planes), site)",
        "(plane // planes).to(tl.int32), site)",
        ["tests/unit/keyed/test_kernels.py::test_the_dropout_kernel_keeps_what_the_torch_path_keeps"]),
    "backward-drops-another-mask": (
        "attention's backward drops the forward's probabilities, not another mask",
        "BLOCK_M, 1), p, zero)",
        "BLOCK_M, 0), p, zero)",
        ["tests/unit/keyed/test_kernels.py::test_attention_outputs_and_gradients_equal_the_explicit_path",
         "tests/unit/keyed/test_kernels.py::test_attention_over_several_tiles_equals_the_explicit_path"]),
    "compiled-draws-break-the-graph": (
        "a compiled forward traces its keyed draws without a graph break",
        "    word = _SITE_WORDS.get(site)",
        "    word = None",
        ["tests/system/test_kernels.py::test_a_compiled_bert_forward_draws_in_one_graph"]),
    "draws-keyed-by-batch-position": (
        "a sample's key is made from its index in the dataset, not its place in the batch",
        "sample_keys(self.batches.seed, self.epoch, part)",
        "sample_keys(self.batches.seed, self.epoch, range(len(part)))",
        ["tests/unit/data/test_global_batches.py::test_each_micro_batch_carries_the_keys_of_its_own_samples",
         "tests/system/test_parity.py::test_two_uneven_ranks_match_one_process"]),
    "draws-depend-on-padding": (
        "a position's draw does not depend on the length a sequence is padded to",
        "torch.arange(rows, device=device).view(1, 1, -1, 1),",
        "(torch.arange(rows, device=device) + rows).view(1, 1, -1, 1),",
        ["tests/unit/keyed/test_randomness.py::test_a_samples_mask_does_not_depend_on_its_batch_or_its_padding",
         "tests/system/test_randomness.py::test_dropout_models_split_over_ranks_match_one_process"]),
    "draws-ignore-the-epoch": (
        "each epoch draws new masks for a sample",
        "    for word in (seed % WORD, seed // WORD % WORD, epoch % WORD):",
        "    for word in (seed % WORD, seed // WORD % WORD):",
        ["tests/unit/keyed/test_randomness.py::test_the_draw_on_tensors_equals_the_draw_on_python_integers",
         "tests/unit/keyed/test_randomness.py::test_every_key_part_changes_the_draw"]),
    "checkpoint-unpickles-code": (
        "a checkpoint carrying pickled code is refused and the code never runs",
        '    return torch.load(file, map_location="cpu", weights_only=True)',
        '    return torch.load(file, map_location="cpu", weights_only=False)',
        ["tests/system/test_untrusted.py::test_a_checkpoint_carrying_code_is_refused_and_the_code_never_runs"]),
    "peer-payload-unpickles-code": (
        "a collective's payload carrying pickled code is refused and the code never runs",
        '    return torch.load(file, map_location="cpu", weights_only=True)',
        '    return torch.load(file, map_location="cpu", weights_only=False)',
        ["tests/unit/checkpoints/test_untrusted.py::test_a_payload_from_a_peer_carrying_code_is_refused_and_the_code_never_runs"]),
    "data-position-lost": (
        "the data position is kept in samples: the epoch goes on from the saved sample",
        "        self.samples_in_epoch = state.get(\"samples_in_epoch\")",
        "        self.samples_in_epoch = 0",
        ["tests/system/test_checkpoint.py::test_resume_with_another_global_batch_uses_every_sample_once"]),
    "checkpoint-key-renamed": (
        "a checkpoint key keeps its name: the previous release's checkpoints resume",
        '\nOPTIMIZER = CONTROLLER.key("optimizer", reset="optimizer")',
        '\nOPTIMIZER = CONTROLLER.key("optimizer_state", reset="optimizer")',
        ["tests/unit/run/test_checkpoint.py::test_every_key_of_a_checkpoint_is_declared_once",
         "tests/system/test_checkpoint.py::test_checkpoints_of_the_previous_release_resume_exactly"]),
    "every-rank-resumes-rank-0s-optimizer": (
        "--local-steps: each rank resumes its own inner optimizer state",
        "            return by_rank[self.ctx.rank]\n",
        "            return by_rank[0]\n",
        ["tests/system/test_local_steps.py::test_resume_mid_round_is_exact_and_keeps_every_ranks_optimizer",
         "tests/system/test_checkpoint.py::test_checkpoints_of_the_previous_release_resume_exactly"]),
    "reset-flags-ignored": (
        "--reset-optimizer/-dataloader/-meters leave that state out of a resume",
        "if reset is not None and getattr(cfg, \"reset_\" + reset.replace(\"-\", \"_\"))}",
        "if False}",
        ["tests/system/test_checkpoint.py::test_reset_flags_keep_the_model_only"]),
    "meters-reset-on-resume": (
        "a resumed epoch's running averages go on",
        "        if not resumed:\n            self.meters.reset()",
        "        self.meters.reset()",
        ["tests/system/test_checkpoint.py::test_reset_flags_keep_the_model_only"]),
    "write-in-place": (
        "a crash while saving keeps the previous checkpoint (atomic rename)",
        "    fd, tmp = tempfile.mkstemp(prefix=\".tmp-\", suffix=\".pt\", dir=folder)",
        "    fd, tmp = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), dst",
        ["tests/system/test_checkpoint.py::test_kill_while_saving_keeps_the_previous_checkpoint"]),
    "no-agreement-check": (
        "ranks that drift apart are brought back, ranks that diverge stop the run",
        "        if disagreeing(checksums) and not self.members.sitting:\n",
        "        if False:\n",
        ["tests/system/test_agreement.py", "tests/unit/update/test_agreement.py"]),
    "stateless-optimizer-state": (
        "a stateless optimizer's checkpoint resumes under --zero 2/3",
        "        if not state[\"state\"]:\n",
        "        if False:\n",
        ["tests/system/test_sharding.py::test_resume_of_a_stateless_optimizer_under_another_mode_and_world"]),
    "slices-overlap": (
        "rank i takes a contiguous slice of each global batch; every sample once per epoch",
        "        start = sum(sizes[:rank])\n",
        "        start = 0\n",
        ["tests/unit/data/test_global_batches.py::test_every_index_once_per_epoch_with_uneven_splits"]),
    "non-finite-applied": (
        "a NaN/inf loss or gradient skips the update on every rank",
        "            self.members.tell(finite, self.num_updates + finite)\n"
        "        return finite, norm\n",
        "            self.members.tell(finite, self.num_updates + finite)\n"
        "        return True, norm\n",
        ["tests/system/test_checkpoint.py::test_non_finite_gradient_on_one_rank_skips_on_all"]),
    "identity-not-compared": (
        "a node whose job flags differ is refused before it claims a rank",
        "        held = store.get(\"hetseq/job\").decode(\"utf-8\", \"replace\")\n        if held == mine:\n",
        "        held = store.get(\"hetseq/job\").decode(\"utf-8\", \"replace\")\n        if True:\n",
        ["tests/system/test_job_identity.py::test_node_with_other_seed_and_epochs_is_refused_naming_both"]),
    "lost-rank-unnamed": (
        "the survivors of a lost rank stop with code 3 naming it and its host",
        "        lost = [r for r in silent if r != rank]\n",
        "        lost = []\n",
        ["tests/system/test_checkpoint.py::test_sigkill_of_one_rank_names_it"]),
    "stale-file-joined": (
        "a file:// meeting point left by a killed job is recognised and named",
        "    if not members:\n        return\n",
        "    return\n",
        ["tests/system/test_startup.py::test_file_left_by_a_killed_job_is_named"]),
    "elastic-state-from-rank-0": (
        "an elastic generation takes the state of the member with the most completed updates",
        "return max(candidates, key=newness), refused",
        "return 0, refused",
        ["tests/unit/elastic/test_elastic.py::test_the_state_comes_from_the_member_with_the_most_updates"]),
    "elastic-snapshot-skips-the-update-in-flight": (
        "survivors drop the update in flight: its samples are trained in the next generation",
        "return dict(self._completed).get(self.controller.num_updates, self._drawn)",
        "return self._drawn",
        ["tests/system/test_elastic_scale.py::test_sixteen_nodes_lose_a_killed_and_a_frozen_host_and_a_waiting_node_takes_a_place"]),
    "elastic-join-signal-ignored": (
        "a node started later joins the running job at an update boundary",
        "self._reconfigure = any(result.ranks.signal)",
        "self._reconfigure = False",
        ["tests/system/test_elastic.py::test_a_lost_host_an_intruder_and_a_late_joiner"]),
    "elastic-rounds-without-quorum": (
        "a round closes only with a quorum of the previous generation: a split trains one side",
        "return 2 * present > len(old) or (2 * present == len(old) and old[0] in arrived_ids)",
        "return True",
        ["tests/system/test_elastic.py::test_a_split_into_halves_trains_on_one_side_only"]),
    "elastic-paused-node-ignores-the-newer-generation": (
        "a node that wakes up after the job went on joins it instead of leading its own",
        'newer = [s for s in said if s is not None and s["generation"] > own]',
        "newer = []",
        ["tests/system/test_elastic.py::test_a_paused_meeting_point_rejoins_the_job_and_never_trains_alone"]),
    "elastic-max-nodes-cuts-in-arrival-order": (
        "--max-nodes orders first (the leader, old members), then cuts",
        "return (lead + old + new)[:max_nodes or None]",
        "return [m for m in lead + old + new if m in arrived[:max_nodes or None]]",
        ["tests/unit/elastic/test_elastic.py::test_ranks_are_ordered_before_max_nodes_cuts"]),
    "elastic-waiting-node-calls-meetings": (
        "a node without a place (--max-nodes) waits without calling a meeting each update",
        "            if rounds.full(store, self.max_nodes):\n",
        "            if False:\n",
        ["tests/system/test_elastic_scale.py::test_sixteen_nodes_lose_a_killed_and_a_frozen_host_and_a_waiting_node_takes_a_place"]),
    "elastic-lineage-ignored": (
        "a state that is not on the job's line is refused as the source",
        "if line is not None and not on_line(members[r][\"lineage\"], line)]",
        "if False]",
        ["tests/unit/elastic/test_elastic.py::test_a_state_from_another_lineage_is_refused"]),
    "elastic-received-state-not-checked": (
        "every rank refuses a source state whose lineage is not the one the round agreed on",
        "if list(got) != list(lineage):",
        "if False:",
        ["tests/unit/run/test_checkpoint.py::test_an_elastic_state_keeps_its_lineage_and_another_line_is_refused"]),
    "gate-handshakes-uncapped": (
        "a flood of idle connections holds at most HANDSHAKES sockets in rank 0",
        "            if sum(self._busy.values()) < self.handshakes and \\\n",
        "            if True or \\\n",
        ["tests/system/test_gate.py::test_a_flood_of_idle_connections_neither_stops_the_job_nor_shuts_its_door"]),
    'gate-accept-error-fatal': (
        'a failed accept is waited out; only closing the listener ends the gate',
        '            except Exception as err:      # EMFILE, ECONNABORTED, MemoryError: never the '
        'end\n                if listener.fileno() == -1:',
        '            except Exception as err:\n                if True:',
        ['tests/unit/store/test_gate.py::test_failed_accepts_are_waited_out_and_only_a_close_ends_the_gate']),
    'gate-handshake-deadline-per-read': (
        "the gate's handshake deadline bounds the whole handshake",
        'keys = handshake_as_server(sock, self.secret, time.monotonic() + HANDSHAKE_S,',
        'keys = handshake_as_server(sock.settimeout(HANDSHAKE_S) or sock, self.secret, None,',
        ['tests/system/test_gate.py::test_a_handshake_that_trickles_is_dropped_at_its_deadline']),
    'gate-busy-not-retried': (
        "a client told 'busy' asks again until its patience ends",
        '            if time.monotonic() + pause > give_up:',
        '            if True:',
        ['tests/system/test_gate.py::test_over_its_cap_the_gate_answers_busy_at_once_and_a_member_gets_its_turn']),
    "gate-over-cap-gets-a-thread": (
        "over the cap a connection is answered busy at once",
        "            if sum(self._busy.values()) < self.handshakes and \\\n",
        "            if True or \\\n",
        ["tests/system/test_gate.py::test_over_its_cap_the_gate_answers_busy_at_once_and_a_member_gets_its_turn"]),
    'secret-bits-not-counted': (
        'a secret needs 112 bits by its alphabet',
        '    bits = round(counted * alphabet[2])',
        '    bits = counted * 8',
        ['tests/unit/store/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-words-accepted': (
        'a secret of words joined by - or _ is refused',
        '    if len(parts) >= 3 and all(WORD_PART.fullmatch(part) for part in parts):',
        '    if False:',
        ['tests/unit/store/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-empty-means-none': (
        'HETSEQ_JOB_SECRET set but empty is an error',
        '    elif SECRET_VARIABLE in env:',
        '    elif env.get(SECRET_VARIABLE, "").strip():',
        ['tests/unit/store/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one']),
    'secret-file-follows-links': (
        'the secret file is not opened through a symbolic link',
        'os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC',
        'os.O_RDONLY | os.O_CLOEXEC',
        ['tests/unit/store/test_secret.py::test_the_secret_file_is_checked_on_what_was_opened']),
    'secret-file-stat-by-path': (
        "the secret file's mode is checked on the opened descriptor",
        '        info = os.fstat(fd)',
        '        info = os.stat(path)',
        ['tests/unit/store/test_secret.py::test_the_secret_file_is_checked_on_what_was_opened']),
    'hetseq-secret-file-not-private': (
        'hetseq-secret --file writes a new file of mode 600',
        'os.O_CLOEXEC, 0o600)',
        'os.O_CLOEXEC, 0o666)',
        ['tests/system/test_secret.py::test_hetseq_secret_makes_accepted_secrets_and_private_files']),
    'meeting-port-taken-silently': (
        'a URL port held by another program is an error',
        '    raise UserError(_in_use(address, port))',
        '    return _listen(url, address, 0)',
        ['tests/unit/store/test_gate.py::test_a_taken_port_is_an_error_unless_a_node_of_this_job_holds_it']),
    'heartbeat-cuts-nothing': (
        "a member whose heartbeat stopped has its connections cut (not left to the timeout)",
        '        closed = cut(address, self.spare)',
        '        closed = 0',
        ['tests/system/test_elastic_scale.py::test_sixteen_nodes_lose_a_killed_and_a_frozen_host_and_a_waiting_node_takes_a_place']),
    'meeting-port-no-second-node': (
        'a second node of the same job on one host takes another port',
        '    if holder is None:',
        '    if True:',
        ['tests/unit/store/test_gate.py::test_a_taken_port_is_an_error_unless_a_node_of_this_job_holds_it']),
    'meeting-point-ipv4-only': (
        "an IPv6 member serves the URL's port",
        '    family = socket.AF_INET6 if ":" in address else socket.AF_INET\n    return socket.create_server((address, port), family=family, backlog=128)',
        '    family = socket.AF_INET\n    return socket.create_server((address, port), family=family, backlog=128)',
        ['tests/unit/store/test_gate.py::test_an_elastic_member_serves_an_ipv6_address_at_the_urls_port']),
    "store-on-every-address": (
        "a store never listens on every address; this host's ranks meet rank 0 where it listens",
        "    return interfaces.primary_address()\n",
        '    return "::" if socket.has_dualstack_ipv6() else "0.0.0.0"\n',
        ["tests/unit/store/test_gate.py::test_a_store_never_listens_on_every_address"]),
    'collective-sizes-unbounded': (
        'sizes announced by peers are bounded (0..MAX_OBJECT_BYTES)',
        '    if not 0 <= size <= MAX_OBJECT_BYTES:',
        '    if size > MAX_OBJECT_BYTES:',
        ['tests/unit/store/test_gate.py::test_sizes_announced_by_peers_are_bounded_before_anything_is_allocated']),
    'store-server-wait-ignores-departure': (
        'a waiting server thread ends when its client leaves',
        'execute(table, op, args, lambda: _client_gone(sock))',
        'execute(table, op, args, None)',
        ['tests/unit/store/test_store.py::test_a_waiting_server_thread_ends_when_its_client_leaves']),
    'store-message-bound': (
        'a message over MAX_MESSAGE is refused from its header',
        '    if total > MAX_MESSAGE:',
        '    if False:',
        ['tests/unit/store/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-key-bound': (
        'keys over MAX_KEY close the connection',
        'return self.blob(MAX_KEY, "key")',
        'return self.blob(MAX_VALUE, "key")',
        ['tests/unit/store/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-unknown-op-answered': (
        'an unknown op closes the connection',
        '        raise Malformed(f"unknown op {request[0] if request else None}")',
        '        return bytes([INVALID]) + blob(b"unknown op")',
        ['tests/unit/store/test_store.py::test_malformed_requests_close_only_their_connection']),
    'store-no-socket-bound': (
        'a call on a server that never answers ends after the store timeout',
        '    seconds = 0 if seconds is None else max(seconds, 0.001)',
        '    seconds = 0',
        ['tests/unit/store/test_store.py::test_a_frozen_server_does_not_hang_a_call']),
    'store-client-timeout-ignored': (
        "get/wait honour the store's timeout with DistStoreError",
        '        seconds = _seconds(self.timeout if timeout is None else _delta(timeout))',
        '        seconds = None',
        ['tests/unit/store/test_store.py::test_get_and_wait_time_out_with_dist_store_error']),
    'store-lost-connection-type': (
        'a lost connection raises DistNetworkError',
        '            self._lose(str(err) or type(err).__name__)\n            raise dist.DistNetworkError(',
        '            self._lose(str(err) or type(err).__name__)\n            raise ConnectionError(',
        ['tests/unit/store/test_store.py::test_a_server_that_goes_away_ends_a_blocked_call']),
    'store-loopback-tcpstore': (
        'no unauthenticated listener: another uid cannot read a key',
        '    store = LocalStore(Table(), timeout)\n    store.gate = gate.Gate(listener, secret, serve_connection(store.table))',
        '    store = dist.TCPStore("127.0.0.1", 0, None, True, _delta(timeout), wait_for_workers=False)\n    gate.Gate(listener, secret, serve_connection(Table()))',
        ['tests/system/test_store.py::test_another_uid_cannot_reach_the_store_without_the_handshake']),
    "elastic-rounds-of-one-generation-stay-apart": (
        "two rounds of one generation meet at the lower-ranked leader",
        "        target = newer or self._lower_round(live, previous)\n",
        "        target = newer\n",
        ["tests/system/test_elastic.py::test_two_rounds_of_one_generation_meet_at_the_lower_ranked_leader"]),
    "elastic-non-leader-hides-where-it-meets": (
        "a node that met at a member which is not leading follows that member to its round",
        '            if store.check([f"e/{number}/at"]):      # not the leader: it meets elsewhere\n',
        "            if False:\n",
        ["tests/system/test_elastic.py::test_two_rounds_of_one_generation_meet_at_the_lower_ranked_leader"]),
    "gate-no-cap-per-address": (
        "one address cannot take every place in the gate's handshakes",
        "                    self._busy.get(source, 0) < self.per_source:",
        "                    True:",
        ["tests/unit/store/test_gate.py::test_one_address_cannot_take_every_place_in_the_handshake"]),
    "store-answer-built-before-measured": (
        "a small request cannot make the store build a huge answer",
        "    if op == MULTI_GET and sum(len(value) + 4 for value in result) > MAX_MESSAGE:",
        "    if False:",
        ["tests/unit/store/test_store.py::test_a_small_request_cannot_make_the_server_build_a_huge_answer"]),
    "secret-typed-shapes-accepted": (
        "secrets with the shapes of typed text are refused",
        '    alphabet = next((a for a in ALPHABETS if set(text) <= a[1]), None)',
        '    alphabet = next((a for a in ALPHABETS if set(text) <= a[1]), ALPHABETS[-1])',
        ["tests/unit/store/test_secret.py::test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one"]),
    "torchrun-restart-sees-old-claims": (
        "a job under torchrun --max-restarts resumes after a restart",
        'restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")',
        "restart = None",
        ["tests/system/test_launchers.py::test_torchrun_restart_resumes_from_the_checkpoint_exactly"]),
    "local-steps-ranks-weighted-equally": (
        "--local-steps: a round's changes are weighted by the samples each rank processed",
        "self.end_round(samples / everyone if everyone > 0 else 0.0, settle=boundary)",
        "self.exchange(1.0 / self.ctx.world_size, settle=boundary)",
        ["tests/system/test_local_steps.py::test_exact_where_the_mathematics_says_so"]),
    "local-steps-inner-gradient-averaged-over-ranks": (
        "--local-steps: an inner step follows the gradient of the rank's own mean loss",
        "        self.divisor = 1\n",
        "",
        ["tests/system/test_local_steps.py::test_exact_where_the_mathematics_says_so"]),
    "outer-overlap-drops-the-own-change": (
        "--outer-overlap: a rank keeps its own change until the round's average lands",
        "self.flat.write([g - d for g, d in zip(self.anchor, change)])",
        "self.flat.write(self.anchor)",
        ["tests/unit/update/test_local_steps.py::test_overlap_alone_follows_the_local_trajectory"]),
    "save-inside-a-round": (
        "--local-steps: a save ends the round, so a resume is exact",
        "        return self.validates or self.saves or self.ends",
        "        return self.validates or self.ends",
        ["tests/system/test_local_steps.py::test_resume_mid_round_is_exact_and_keeps_every_ranks_optimizer"]),
    "powersgd-hook-not-registered": (
        "--grad-compression powersgd compresses the gradient all-reduce",
        "        return powersgd_hook(self.cfg)\n",
        "        return None\n",
        ["tests/system/test_local_steps.py::test_compressed_exchanges_stay_near_the_exact_one"]),
    "optimizer-mismatch-not-detected": (
        "a checkpoint of another optimizer is refused before training, in one line",
        "            check_same_optimizer(own, *self._optimizer_kind)\n",
        "",
        ["tests/system/test_bad_inputs.py::test_bad_input_gives_one_clear_message"]),
    "compile-compiles-nothing": (
        "--compile compiles the model's forward",
        "self.model.forward = torch.compile(self.model.forward)",
        "self.model.forward = self.model.forward",
        ["tests/unit/update/test_parity.py::test_compile_traces_the_forward_and_keeps_the_parameter_names"]),
    "node-lines-from-rank-0-only": (
        "every node prints when it joins and ends, not only rank 0's",
        "setup_logging(rank, all_ranks=node.log.log_all_ranks, node_first=index == 0)",
        "setup_logging(rank, all_ranks=node.log.log_all_ranks)",
        ["tests/system/test_first_hour.py::test_two_nodes_print_progress_rates_and_their_own_lines"]),
    "lr-line-claims-the-planned-horizon": (
        "the LR-schedule line states the horizon actually used",
        'source = "--total-num-update" if self.cfg.total_num_update else "the planned run"',
        'source = "the planned run"',
        ["tests/system/test_first_hour.py::test_two_nodes_print_progress_rates_and_their_own_lines"]),
    'resync-buckets-split-by-device': (
        "a GPU and a CPU rank make the same broadcasts in a resync (buckets follow dtypes)",
        "        if bucket and (size + tensor.numel() > limit or tensor.dtype != bucket[0].dtype):",
        "        if bucket and (size + tensor.numel() > limit or tensor.dtype != bucket[0].dtype\n"
        "                       or tensor.device != bucket[0].device):",
        ['tests/unit/update/test_agreement.py::test_ranks_split_their_state_alike_whatever_device_holds_it']),
    'watchdog-judges-after-its-own-stall': (
        "a member that was paused does not take the others' silence for theirs",
        "            self.heard = dict.fromkeys(self.heard, now)",
        "            pass",
        ['tests/unit/elastic/test_elastic.py::test_a_watchdog_that_stalled_itself_gives_every_member_a_fresh_window']),
    'watchdog-times-the-leader-before-its-query': (
        "the meeting point's host frozen or cut off is told after one --heartbeat-timeout",
        "else silence.lost(counts, now)",
        "else silence.lost(counts, waited_from + INTERVAL_S / 2)",
        ['tests/system/test_elastic.py::test_a_silent_leaders_store_tells_the_leader_lost_after_one_timeout']),
    'round-waits-for-a-refusing-member': (
        "a killed member costs no straggler wait: the round closes when the others came",
        "set(previous.ids) - self.m.lost - self.m.unreachable)",
        "set(previous.ids) - self.m.lost)",
        ['tests/system/test_elastic.py::test_a_round_does_not_wait_for_a_member_whose_store_refused']),
    'round-forgets-nodes-waiting-for-a-place': (
        "--max-nodes: a node waiting for a place is in the round that frees one",
        " | set(waiting.values())\n",
        "\n",
        ['tests/system/test_elastic.py::test_a_round_does_not_wait_for_a_member_whose_store_refused']),
    'round-skips-a-slow-member': (
        "a member slow to answer the walk for the leader is still waited for",
        "        except (UserError, OSError):\n            return SILENT",
        "        except (UserError, OSError):\n            return REFUSED",
        ['tests/system/test_elastic.py::test_a_member_whose_port_refuses_is_told_apart_from_a_slow_one']),
    'elastic-round-not-rewound': (
        "--elastic with --local-steps: a snapshot inside a round goes back to its start",
        "        elif self.anchor is not None:     # inside a round (None: at an outer step)",
        "        elif False:",
        ['tests/unit/update/test_local_steps.py::test_an_elastic_snapshot_inside_a_round_goes_back_to_its_start']),
    'every-rank-reads-every-beat': (
        "the leader's store serves each rank a constant number of keys a heartbeat",
        "        self.watched = self.beats if rank == 0 else self.beats[:1]",
        "        self.watched = self.beats",
        ['tests/unit/elastic/test_elastic_scale.py::test_only_rank_0_reads_every_heartbeat']),
    'lost-ranks-kept-by-rank-0': (
        "rank 0 tells every rank which rank went silent",
        "            if found and self.rank == 0:",
        "            if False:",
        ['tests/system/test_elastic_scale.py::test_rank_0_tells_every_rank_which_rank_went_silent']),
    'a-failed-collective-ends-only-its-rank': (
        "a rank whose collective failed ends the generation for every rank at once",
        "            if ended:\n                self._end_here()",
        "            if False:\n                self._end_here()",
        ['tests/unit/elastic/test_elastic_scale.py::test_a_failed_collective_anywhere_closes_every_ranks_process_group']),
    'cut-closes-the-stores-too': (
        "cutting a process group's connections keeps the stores' connections",
        "            if _proc_port(fields[1]) in spare or _proc_port(fields[2]) in spare:",
        "            if False:",
        ['tests/unit/elastic/test_elastic_scale.py::test_a_failed_collective_anywhere_closes_every_ranks_process_group']),
    'placed-member-arrives-late': (
        "a member placed in a round whose outcome it did not read enters that generation",
        '        if node_id not in [m.get("id") for m in outcome.get("members", ())]:',
        '        if True:',
        ['tests/unit/elastic/test_elastic_scale.py::test_a_member_placed_in_a_round_it_did_not_read_enters_that_generation']),
    'overlapped-rewind-drops-the-arrived-round': (
        "--elastic --outer-overlap: a round whose exchange arrived is applied, not trained again",
        "        if self.pending is None or self._arrived():",
        "        if self.pending is None:",
        ['tests/unit/update/test_local_steps.py::test_an_overlapped_snapshot_goes_back_to_the_last_round_whose_exchange_arrived',
         'tests/system/test_elastic.py::test_overlapped_rounds_go_back_to_the_last_exchange_that_arrived']),
    'overlapped-rewind-keeps-a-failed-round': (
        "--elastic --outer-overlap: a round whose exchange failed is trained again",
        "            target = self.starts[-2] if inside else self.starts[-1]",
        "            target = now_start",
        ['tests/unit/update/test_local_steps.py::test_an_overlapped_snapshot_goes_back_to_the_last_round_whose_exchange_arrived']),
    'overlapped-rewind-misses-the-open-round': (
        "--elastic --outer-overlap: a round whose statistics failed is still open (not sent)",
        "        inside = self.open ",
        "        inside = self.steps > 0 ",
        ['tests/system/test_elastic.py::test_overlapped_rounds_go_back_to_the_last_exchange_that_arrived']),
    'snapshot-forgets-the-round-before': (
        "a snapshot's data position is the one of the update it went back to, one of two rounds",
        "return dict(self._completed).get(",
        "return dict(list(self._completed)[-1:]).get(",
        ['tests/unit/update/test_local_steps.py::test_a_snapshot_takes_the_data_position_of_the_update_it_went_back_to']),
    'every-member-walks-every-member': (
        "a member that will not lead asks the previous members only up to the first that answers",
        '        if first is not None and members[first]["id"] == self.id:',
        '        if True:',
        ['tests/unit/elastic/test_elastic_scale.py::test_a_member_asks_the_previous_members_only_up_to_the_first_that_answers']),
    'a-rank-that-never-beat-is-waited-for': (
        "a rank frozen before its first heartbeat is told silent after the timeout",
        "if store.check([k]) else None",
        "if store.check([k]) else str(beats)",
        ['tests/system/test_elastic_scale.py::test_a_rank_that_never_beat_is_told_silent']),
    'validation-inside-a-round': (
        "--validate-interval-updates ends a round of --local-steps: every rank validates one model",
        "        return self.validates or self.saves or self.ends",
        "        return self.saves or self.ends",
        ['tests/system/test_local_steps.py::test_a_validation_between_updates_ends_the_round']),
    'validation-twice-at-an-epoch-end': (
        "an interval validation that falls on an epoch's end is made once",
        "        if self._validated is not None and self._validated[0] == updates:",
        "        if False:",
        ['tests/system/test_local_steps.py::test_a_validation_between_updates_ends_the_round']),
    'default-outer-step-back-to-diloco': (
        "the default outer step is the weighted average (H = 1 and SGD: the synchronous update)",
        'outer_lr: float = flag(1.0, type=float, metavar="ETA",',
        'outer_lr: float = flag(0.7, type=float, metavar="ETA",',
        ['tests/system/test_local_steps.py::test_exact_where_the_mathematics_says_so']),
    'a-round-outlives-its-generation': (
        "--elastic --local-steps: a rank told by its heartbeats that the generation is over leaves between inner steps",
        "        if self.place.over():",
        "        if False:",
        ['tests/system/test_elastic.py::test_a_member_lost_inside_a_round_ends_the_generation_between_inner_steps']),
    'a-lost-member-at-the-last-barrier-fails-the-others': (
        "--elastic: a member lost at the job's last barrier leaves the others finished",
        "    except RuntimeError as err:     # a member lost after its last update",
        "    except KeyError as err:     # a member lost after its last update",
        ['tests/unit/elastic/test_elastic.py::test_a_member_lost_at_the_last_barrier_leaves_the_others_finished']),
    'interval-validation-not-for-best': (
        "a validation between epoch ends counts for checkpoint_best",
        "                self._save(None, metric)",
        "                self._save(None, None)",
        ['tests/system/test_checkpoint.py::test_validations_between_epoch_ends_count_for_the_best_checkpoint']),
    'secret-on-a-command-line': (
        "hetseq-launch: the job secret is in no process's command line",
        "        self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE,\n"
        "                                     stdout=",
        "        command = [*command[:-1], command[-1] + ' # ' + env.get('HETSEQ_JOB_SECRET', '')]\n"
        "        self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE,\n"
        "                                     stdout=",
        ['tests/system/test_launch.py::test_a_heterogeneous_job_over_ssh_equals_one_process_and_never_shows_its_secret']),
    'job-flag-in-a-hostfile': (
        "hetseq-launch: a job flag in the hostfile is refused, naming it",
        "        if dest not in node_dests:",
        "        if False:",
        ['tests/unit/launch/test_launch.py::test_a_wrong_hostfile_or_flag_is_named',
         'tests/system/test_launch.py::test_cli_refuses_a_job_flag_in_the_hostfile_in_one_line']),
    'a-node-outlives-its-input': (
        "hetseq-launch: a node stops when its input ends (Ctrl-C, a killed launcher, a dropped connection)",
        '        if not chunk or KILL in chunk or b"stop" in chunk:',
        '        if KILL in chunk or b"stop" in chunk:',
        ['tests/system/test_launch.py::test_a_killed_launcher_leaves_no_node_behind',
         'tests/system/test_launch.py::test_ctrl_c_stops_every_node_and_an_elastic_job_goes_on_without_a_host_that_is_down']),
    'unreachable-host-leaves-the-others-running': (
        "hetseq-launch: a host that cannot be reached stops the others (fixed job)",
        "            if not self.job.elastic:\n                self._stopped_by(UNREACHABLE",
        "            if False:\n                self._stopped_by(UNREACHABLE",
        ['tests/system/test_launch.py::test_an_unreachable_host_is_named_and_the_others_are_stopped']),
    'exit-code-not-the-worst': (
        "hetseq-launch: the exit code says the job failed (255: a host not reached)",
        "        return max(codes, default=NOT_STARTED)\n",
        "        return 0\n",
        ['tests/system/test_launch.py::test_an_unreachable_host_is_named_and_the_others_are_stopped']),
    'status-without-hosts': (
        "hetseq-status: every rank with its host",
        '        return [{"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?",',
        '        return [{"rank": r, "host": "?",',
        ['tests/system/test_launch.py::test_a_heterogeneous_job_over_ssh_equals_one_process_and_never_shows_its_secret']),
    "status-does-not-follow-the-leader": (
        "hetseq-status: any elastic member's address shows the job (it follows the leader)",
        "    if url_host_port(there) == url_host_port(url):        # (url may end in its job id)\n"
        "        return store, url",
        "    if True:\n        return store, url",
        ["tests/unit/reporting/test_status_viewer.py::test_the_viewer_follows_the_leader_with_the_job_id_it_was_given",
         "tests/system/test_launch.py::test_ctrl_c_stops_every_node_and_an_elastic_job_goes_on_without_a_host_that_is_down"]),
    'validations-not-in-the-plot': (
        "hetseq-plot: every validation beside the training loss",
        "        self.valid_log.record(update, epoch, split, metrics)\n",
        "",
        ['tests/system/test_first_hour.py::test_plot_of_a_real_run']),
    'plot-labels-overlap': (
        "hetseq-plot: no label overlaps another or a legend, no legend covers a point",
        '        ax_loss.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1),',
        '        ax_loss.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 0),',
        ['tests/unit/reporting/test_plot.py::test_a_short_run_with_one_validation_and_equal_shares',
         'tests/unit/reporting/test_plot.py::test_bert_validation_metrics_read_each_on_its_own_scale']),
    'plot-metrics-share-the-loss-axis': (
        "hetseq-plot: each validation metric on its own scale, the loss panel for the loss alone",
        '            v for v in valid.items() if v[0][1] == "loss")):',
        '            v for v in valid.items() if is_loss(v[0][1]))):',
        ['tests/unit/reporting/test_plot.py::test_bert_validation_metrics_read_each_on_its_own_scale']),
    'plot-equal-shares-show-one-rank': (
        "hetseq-plot: the ranks' shares stacked, every rank in the legend, equal shares too",
        '    ax_share.stackplot(steps, *stacked, labels=[f"rank {r}" for r in range(count)], alpha=0.8)',
        '    ax_share.plot(steps, stacked[0], label="rank 0")',
        ['tests/unit/reporting/test_plot.py::test_a_short_run_with_one_validation_and_equal_shares',
         'tests/unit/reporting/test_plot.py::test_a_long_run_with_validations_and_unequal_shares']),
    'plot-long-runs-marked': (
        "hetseq-plot: a long run's series drawn as thin lines, without markers",
        "MARKERS_UP_TO = 50 ",
        "MARKERS_UP_TO = 10 ** 6 ",
        ['tests/unit/reporting/test_plot.py::test_a_long_run_with_validations_and_unequal_shares']),
    'a-slow-member-taken-for-another-job': (
        "a second node on a member's host asks a member slow to greet again before calling its port another job's",
        "HOLDER_TRIES = 3",
        "HOLDER_TRIES = 1",
        ['tests/unit/store/test_gate.py::test_a_member_slow_to_greet_still_holds_its_port']),
    'a-killed-wrapper-leaves-its-command': (
        "hetseq-launch: a node wrapper killed with SIGKILL takes its command along",
        "        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)",
        "        pass",
        ['tests/system/test_launch.py::test_a_killed_node_wrapper_takes_its_command_along_and_its_end_stops_the_job']),
    'exit-code-of-the-stopped-not-the-cause': (
        "hetseq-launch: the exit code is that of the node whose end stopped the others",
        "        if self.cause is not None:\n            return self.cause\n",
        "",
        ['tests/system/test_launch.py::test_a_killed_node_wrapper_takes_its_command_along_and_its_end_stops_the_job']),
    'a-stopping-rank-drops-its-sent-round': (
        "--outer-overlap: a rank that stops on its own error lets the round it sent complete first",
        "            self.controller.exchange.drain()\n",
        "            pass\n",
        ['tests/unit/update/test_local_steps.py::test_a_rank_stopping_on_its_own_error_lets_the_round_it_sent_complete']),
    'a-made-secret-the-rule-refuses': (
        "hetseq-secret never hands out a secret its own rule refuses",
        "        if weakness(text.encode()) is None:\n            return text",
        "        return text",
        ['tests/unit/store/test_secret.py::test_a_drawn_secret_the_rule_refuses_is_drawn_again']),
    'uneven-ranks-split-equally': (
        "--capacity auto under --local-steps: uneven ranks finish each round together",
        "    for rank, share in zip(members, fastest_split(total, [rates[i] for i in members])):",
        "    for rank, share in zip(members, fastest_split(total, [1.0 for i in members])):",
        ['tests/system/test_local_steps.py::test_uneven_ranks_finish_each_round_together']),
    'env-file-of-anyone': (
        "hetseq-launch reads .hetseq_env only when it is the user's own and nobody else can write it",
        "    if mode & 0o022:",
        "    if False:",
        ['tests/unit/launch/test_launch.py::test_an_env_file_others_could_write_is_refused']),
    'nohup-hangup-stops-the-job': (
        "hetseq-launch: a signal ignored when it started (nohup's SIGHUP) stays ignored",
        "        if signal.getsignal(sig) != signal.SIG_IGN:",
        "        if True:",
        ['tests/system/test_launch.py::test_nohup_keeps_the_job_and_ctrl_backslash_stops_it_and_removes_the_secret']),
    'sigquit-leaves-the-secret': (
        "hetseq-launch: Ctrl-\\ stops every node and removes the made secret",
        "STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)",
        "STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)",
        ['tests/system/test_launch.py::test_nohup_keeps_the_job_and_ctrl_backslash_stops_it_and_removes_the_secret']),
    'secret-key-not-stretched': (
        "the handshake key is the secret stretched by scrypt (memory-hard)",
        '    return hashlib.scrypt(digest, salt=b"hetseq job key\\0" + salt, **SCRYPT)',
        '    return hashlib.sha256(digest + salt).digest()',
        ['tests/unit/store/test_secret.py::test_the_key_is_memory_hard_and_salted_with_the_job_id']),
    'uuid1-accepted': (
        "a uuid that is not a uuid4 (a uuid1: a time and a MAC address) is refused",
        '    if version != "4":',
        '    if False:',
        ['tests/unit/store/test_secret.py::test_typed_secrets_that_look_long_are_refused']),
    'secret-lines-not-joined': (
        "generator output that spans lines is one secret",
        '    return b"".join(line.strip() for line in raw.splitlines())',
        '    return raw.strip()',
        ['tests/unit/store/test_secret.py::test_generator_output_that_spans_lines_is_one_secret']),
    'typed-words-accepted': (
        "a secret that reads as English words is refused",
        '    if _english_bits(text) >= ENGLISH_BITS * letters:',
        '    if False:',
        ['tests/unit/store/test_secret.py::test_typed_secrets_that_look_long_are_refused']),
    'keyboard-walk-accepted': (
        "a keyboard walk is refused",
        '    if covered >= WALKED * len(text):',
        '    if False:',
        ['tests/unit/store/test_secret.py::test_typed_secrets_that_look_long_are_refused']),
    'relay-on-the-url-moved-aside': (
        "a relay squatting on the meeting point's port is refused, not moved aside for",
        '    if not _same_place(holder, (address, port)):',
        '    if False:',
        ['tests/unit/store/test_gate.py::test_a_relay_squatting_on_the_meeting_point_is_refused']),
    'accept-loop-dies-on-an-error': (
        "the gate's accept loop survives any error while taking a connection",
        '            except Exception as err:        # out of threads, a bug: this connection only',
        '            except ZeroDivisionError as err:',
        ['tests/unit/store/test_gate.py::test_the_accept_loop_survives_an_error_taking_a_connection']),
    'members-connections-unbounded': (
        "the gate serves at most SERVED connections past the handshake",
        '    if room is not None and not room():',
        '    if False:',
        ['tests/unit/store/test_gate.py::test_a_member_over_the_served_cap_is_told_full_and_gets_in_when_one_ends']),
    'store-table-unbounded': (
        "the job's store holds at most MAX_TABLE_KEYS keys",
        '        if len(self._data) + len(new) > self.max_keys:',
        '        if False:',
        ['tests/unit/store/test_store.py::test_the_table_is_bounded_and_says_so_to_the_member_that_fills_it']),
    'status-waits-without-deadline': (
        "hetseq-status: a silent service at the URL costs --timeout, then one line naming it",
        '        if time.monotonic() >= deadline:\n            raise UserError(\n                f"{url} did not answer',
        '        if False:\n            raise UserError(\n                f"{url} did not answer',
        ['tests/system/test_status_viewer.py::test_a_silent_service_costs_the_timeout_and_is_named']),
    'status-reads-in-the-main-thread': (
        "hetseq-status: Ctrl-C ends it at any moment, even inside TCPStore's recv",
        '    box = {}\n\n    def work():',
        '    return step()\n\n    def work():',
        ['tests/system/test_status_viewer.py::test_ctrl_c_ends_the_wait_for_a_silent_service']),
    'status-nested-json-crashes': (
        "hetseq-status: any value in the store gives a status or one line, never a traceback",
        "    except (ValueError, RecursionError) as err:",
        "    except ValueError as err:",
        ['tests/system/test_status_viewer.py::test_any_value_in_the_store_gives_a_status_or_one_line']),
    'status-numbers-unbounded': (
        "hetseq-status: numbers read are bounded, so drawing cannot overflow",
        "    return value if ok and abs(value) <= MAX_NUMBER else None",
        "    return value if ok else None",
        ['tests/unit/reporting/test_status_viewer.py::test_clean_and_render_take_any_value']),
    'served-place-kept-after-a-reset': (
        "a connection's served place is given back however it ends (a reset before OK)",
        '            if placed:        # however the connection ended, its place is free again',
        '            if placed and keys is not None:',
        ['tests/unit/store/test_gate.py::test_a_member_that_resets_after_its_proof_gives_its_place_back']),
    'full-believed-unproven': (
        "a 'full' answer is believed only with the gate's proof",
        '            raise Refused("it answered \'full\' without proving that it knows the secret")',
        '            pass',
        ['tests/unit/store/test_gate.py::test_full_is_believed_only_with_the_gates_proof']),
    'stated-port-unchecked': (
        "the gate's stated address is checked like any value from the network",
        '            and 1 <= int(port[:6]) <= 65535):',
        '            and True):',
        ['tests/unit/store/test_gate.py::test_a_stated_address_that_is_not_one_is_refused']),
    'leader-read-unbounded': (
        "hetseq-status reads e/leader with the status's bounds",
        '    leader = _json_value(store, "e/leader")',
        '    leader = json.loads(store.get("e/leader"))',
        ['tests/unit/reporting/test_status_viewer.py::test_a_crafted_leader_address_gives_one_line']),
    'helpers-hashed-into-the-identity': (
        "the job identity hashes the code that decides the update, not test helpers or the plot",
        '            if not every_file and relative.startswith(NOT_HASHED):',
        '            if False:',
        ['tests/unit/distributed/test_job_identity.py::test_the_code_digest_counts_what_decides_the_update_only']),
    "user-dir-code-not-in-the-identity": (
        "a --user-dir's code (a task or exchange mode there) is part of the job's identity",
        "            out[\"user_code\"] = self.user_code\n",
        "            pass\n",
        ['tests/unit/distributed/test_job_identity.py::test_a_user_dirs_code_is_part_of_the_job_wherever_it_lies']),
    "mode-update-without-figures": (
        "an exchange mode cannot end an update without this rank's figures: finish is a "
        "template that records them, which no mode may override",
        "            if template in vars(cls):",
        "            if False:",
        ['tests/unit/update/test_exchange_modes.py::'
         'test_a_mode_cannot_forget_its_figures_finish_is_a_template_that_records_them']),
    "round-wall-after-its-exchange": (
        "a round's wall seconds end before its exchange, which the next round's hold",
        "        ended = time.perf_counter()    # the update's end: before a round's exchange\n"
        "        result = self.end(stats, made, norm, boundary)\n",
        "        result = self.end(stats, made, norm, boundary)\n"
        "        ended = time.perf_counter()\n",
        ['tests/unit/update/test_exchange_modes.py::'
         'test_a_rounds_wall_time_ends_before_its_exchange']),
    "time-left-without-validations": (
        "the time left counts the validations still due, before one ran too",
        "            left += count * self.expected(kind, per_update)\n",
        "            left += count * self.took.get(kind, 0.0)\n",
        ['tests/unit/reporting/test_time_left.py::'
         'test_the_time_left_holds_through_a_change_of_speed']),
    "epoch-end-events-ignore-their-interval": (
        "--validate-interval and --save-interval count epochs, in the one schedule",
        "                     (stopping or due(training.validate_interval, epoch)),",
        "                     (stopping or epoch is not None),",
        ['tests/unit/run/test_events.py::test_an_epochs_end_and_the_stop_come_from_the_same_schedule']),
    "accept-loop-dies-on-a-memory-error": (
        "the gate's accept loop survives any error of accept, MemoryError included",
        "            except Exception as err:      # EMFILE, ECONNABORTED, MemoryError: never the end",
        "            except OSError as err:",
        ["tests/unit/store/test_gate.py::test_failed_accepts_are_waited_out_and_only_a_close_ends_the_gate"
         "[MemoryError]"]),
    "typed-uuid4-accepted": (
        "a uuid4's digits are checked as any secret's (00000000-0000-4000-8000-...)",
        '        return _uuid_weakness(text) or _shape(text.replace(b"-", b""), ALPHABETS[1])',
        "        return _uuid_weakness(text)",
        ["tests/unit/store/test_secret.py::test_uuids_typed_or_undashed_and_padding_hold_no_bits"]),
    "padding-counted-as-bits": (
        "base32 and base64 padding holds no bits",
        '    counted = len(text.rstrip(b"="))          # padding holds no bits',
        "    counted = len(text)",
        ["tests/unit/store/test_secret.py::test_uuids_typed_or_undashed_and_padding_hold_no_bits"]),
    "secret-variable-not-utf8-crashes": (
        "a HETSEQ_JOB_SECRET that is not UTF-8 is one line",
        "        raw, where = os.fsencode(env[SECRET_VARIABLE]), SECRET_VARIABLE",
        "        raw, where = env[SECRET_VARIABLE].encode(), SECRET_VARIABLE",
        ["tests/unit/store/test_secret.py::test_a_secret_variable_that_is_not_utf8_is_one_line"]),
    "status-made-up-answer-crashes": (
        "a store answer no store sends (MemoryError in c10d's client) is one line",
        "    except (RuntimeError, ValueError, MemoryError, OverflowError) as err:",
        "    except OverflowError as err:",
        ["tests/unit/reporting/test_status_viewer.py::test_store_answers_no_store_sends_give_one_line"]),
    "status-bad-host-traceback": (
        "a URL naming no host (tcp://a..b:80) is one line",
        "    except ValueError as err:        # UnicodeError: 'a..b' is no host name",
        "    except ZeroDivisionError as err:",
        ["tests/system/test_status_viewer.py::test_a_url_that_names_no_host_is_one_line"]),
    "watch-hides-a-bad-value": (
        "--watch shows a value that is no status instead of looking again silently",
        '            show(f"{url}: {err}")        # it may be published again: look again',
        "            pass",
        ["tests/system/test_status_viewer.py::"
         "test_watch_shows_a_value_that_is_no_status_and_a_closed_pipe_ends_it_quietly"]),
    "closed-pipe-traceback": (
        "a reader that closes the pipe (| head -1) ends the viewer quietly",
        "    except BrokenPipeError:           # | head -1: the reader has what it wanted\n"
        "        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())\n",
        "",
        ["tests/system/test_status_viewer.py::"
         "test_watch_shows_a_value_that_is_no_status_and_a_closed_pipe_ends_it_quietly"]),
    "env-nul-byte-forwarded": (
        ".hetseq_env values every node can take: no NUL byte",
        '        if "\\0" in value:',
        "        if False:",
        ["tests/unit/launch/test_launch.py::test_forwarded_values_every_node_can_take"]),
    "env-variable-unbounded": (
        ".hetseq_env values every node can take: within exec's bound",
        '        if len(f"{name}={value}".encode()) >= MAX_VARIABLE:',
        "        if False:",
        ["tests/unit/launch/test_launch.py::test_forwarded_values_every_node_can_take"]),
    "node-reads-byte-by-byte": (
        "a node reads its line in chunks, not a byte a call",
        "        chunk = os.read(stream.fileno(), 1 << 16)",
        "        chunk = os.read(stream.fileno(), 1)",
        ["tests/unit/launch/test_launch.py::test_a_node_reads_its_line_whole_and_at_once"]),
    "signal-before-start-loses-its-reason": (
        "a signal before the first node starts stops with its reason and 128 + N",
        "        if self.requested and not self.nodes:     # a signal before the first node "
        "started",
        "        if False:",
        ["tests/system/test_launch.py::test_a_signal_before_the_first_node_starts_stops_with_its_reason"]),
    "uneven-gradient-not-divided-by-w": (
        "a rank's gradient range under memory shares is the sum over ranks / W, as in every mode",
        "mine = flat[self.lo:self.hi].to(self.shard.dtype, copy=True).div_(world)",
        "mine = flat[self.lo:self.hi].to(self.shard.dtype, copy=True)",
        ["tests/system/test_parity.py::test_state_shares_by_memory_match_one_process"]),
    "uneven-zero1-ranges-kept-home": (
        "under --zero 1 by memory each owner's updated range reaches every rank",
        "                    flat.share_update()\n",
        "                    pass\n",
        ["tests/system/test_parity.py::test_state_shares_by_memory_match_one_process"]),
    "uneven-zero3-keeps-units-gathered": (
        "--zero 3 by memory frees each unit after its forward, gathers it again for backward",
        "            if self.reshard_after_forward and module is not self._root:",
        "            if False:",
        ["tests/system/test_uneven.py::test_units_are_gathered_while_they_run_and_freed_after"]),
    "uneven-steps-unused-parameters": (
        "a parameter no rank gave a gradient in an update is not stepped under memory shares",
        "piece.grad = self.grad[lo:lo + piece.numel()] if used[i] else None",
        "piece.grad = self.grad[lo:lo + piece.numel()]",
        ["tests/system/test_parity.py::"
         "test_state_shares_by_memory_leave_a_parameter_without_gradient_alone"]),
    "uneven-load-takes-the-first-range": (
        "a rank loads its own range of a full checkpoint",
        "flat.shard.copy_(torch.cat(saved)[flat.lo:flat.hi])",
        "flat.shard.copy_(torch.cat(saved)[:flat.hi - flat.lo])",
        ["tests/system/test_sharding.py::"
         "test_resume_under_another_mode_and_world_equals_an_uninterrupted_run"]),
    "uneven-load-accepts-another-model": (
        "a checkpoint of another model is refused under memory shares, as in every mode",
        "    if missing or unexpected or sizes:",
        "    if False:",
        ["tests/system/test_uneven.py::"
         "test_a_checkpoint_of_another_model_is_refused_by_memory_as_in_every_mode"]),
    "state-shares-even-whatever-memory": (
        "shares by memory follow each rank's memory beyond what it holds whole",
        "    room = [max(0.0, m - size.whole) for m in memories]",
        "    room = [1.0 for m in memories]",
        ["tests/system/test_parity.py::test_state_shares_by_memory_match_one_process",
         "tests/system/test_uneven.py::"
         "test_a_model_too_big_for_the_small_ranks_even_share_trains_with_shares_by_memory"]),
    "elastic-split-snapshot-is-partial": (
        "under a split state a snapshot is the newest full state kept, never a partial one",
        "        if self.split:\n            return self._full\n",
        "",
        ["tests/system/test_elastic_shares.py::test_a_node_joins_a_split_state_and_is_lost_again"]),
    "elastic-split-state-not-kept-at-saves": (
        "under a split state every save keeps the full state: a loss goes back to the last save",
        "        if self.split:\n            self._keep_full()\n",
        "",
        ["tests/system/test_elastic_shares.py::"
         "test_a_member_lost_from_a_split_state_goes_back_to_the_last_save"]),
    # ---- issue 58: code that others can plant never runs; the launcher's faults ----
    "launch-folder-not-checked": (
        "a launch folder another user could change is refused by the launcher",
        "        refuse_unless_owned(os.getcwd(), \"the launch folder\")\n",
        "",
        ["tests/system/test_trust.py::test_a_shared_launch_folder_is_refused_and_a_planted_module_never_runs"]),
    "wrapper-imports-from-its-folder": (
        "the node wrapper and the probe never import from their working folder",
        '"sys.path[:] = [x for x in sys.path if x]; import runpy; "',
        '"import runpy; "',
        ["tests/system/test_trust.py::test_wrappers_and_probes_never_import_from_their_folder"]),
    "wrapper-imports-before-judging-its-folder": (
        "the wrapper judges its folder before it imports anything (an empty PYTHONPATH entry)",
        '"b and (print(f\'hetseq.launch.node: the launch folder {c} could be changed',
        '"False and (print(f\'hetseq.launch.node: the launch folder {c} could be changed',
        ["tests/system/test_trust.py::test_a_shared_launch_folder_is_refused_and_a_planted_module_never_runs"]),
    "folder-above-writable-by-others": (
        "a folder above a path that others may write without the sticky bit makes it theirs",
        "if writable and (target or not mode & stat.S_ISVTX):",
        "if writable and target:",
        ["tests/unit/base/test_trust.py::test_a_path_is_refused_when_it_or_a_folder_above_it_is_not_yours"]),
    "hostfile-not-checked": (
        "a hostfile another user could change is refused",
        "    refuse_unless_owned(path, \"--hostfile\")\n",
        "",
        ["tests/unit/base/test_trust.py::test_a_hostfile_another_user_can_change_is_refused"]),
    "user-dir-not-checked": (
        "a --user-dir another user could change is refused before it is imported",
        "    refuse_unless_owned(path, \"--user-dir\")\n",
        "",
        ["tests/unit/base/test_trust.py::test_a_user_dir_another_user_can_change_is_refused_before_it_is_imported"]),
    "compile-cache-not-checked": (
        "--compile's cache is a folder of the user's own",
        "    refuse_unless_owned(path, what, fix_folder=path)\n",
        "",
        ["tests/unit/base/test_trust.py::test_compile_keeps_its_code_in_a_private_folder"]),
    "node-output-not-buffered": (
        "a paused launcher never stops its nodes: the wrapper holds their output, bounded",
        "                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,\n"
        "                            preexec_fn=die_with_parent)",
        "                            preexec_fn=die_with_parent)\n"
        "    proc.stdout = open(os.devnull, 'rb')",
        ["tests/system/test_trust.py::test_a_paused_launcher_never_stops_its_nodes_and_their_escapes_never_reach_it"]),
    "probe-answer-trusted": (
        "--check reads a probe answer of any shape as a problem line",
        "            unread = malformed(said_facts)\n",
        "            unread = None\n",
        ["tests/system/test_trust.py::test_a_probe_answer_of_any_shape_is_a_problem_line"]),
    "node-escapes-shown": (
        "a node's lines reach the terminal without control characters",
        "        line = printable(raw.decode(\"utf-8\", \"replace\").rstrip(\"\\r\"))",
        "        line = raw.decode(\"utf-8\", \"replace\").rstrip(\"\\r\")",
        ["tests/system/test_trust.py::test_a_paused_launcher_never_stops_its_nodes_and_their_escapes_never_reach_it"]),
    "peer-identity-shown-raw": (
        "a refusal shows a peer's words printable, and an identity of any shape",
        "        theirs = json.loads(held)\n    except (ValueError, RecursionError):",
        "        theirs = json.loads(held)\n        founder = founder.encode().decode()\n"
        "        printable = str\n    except (ValueError, RecursionError):",
        ["tests/unit/base/test_trust.py::test_a_peers_words_reach_the_terminal_printable_and_of_any_shape"]),
    "number-flags-not-finite": (
        "a number flag that is not finite is refused",
        "        self.register(\"type\", float, finite_float)\n",
        "",
        ["tests/unit/base/test_trust.py::test_a_number_flag_that_is_not_finite_is_refused"]),
    # ---- issue 58: a full disk between checkpoints ----
    "report-writer-failure-kills-the-run": (
        "a report file the disk refuses stops with one warning; training goes on",
        "        except OSError as err:\n            self.stop(err)\n            return None",
        "        except ArithmeticError as err:\n            self.stop(err)\n            return None",
        ["tests/system/test_full_disk.py::test_the_balance_and_validation_logs_stop_once_and_keep_whole_lines",
         "tests/system/test_full_disk.py::test_a_disk_that_fills_between_checkpoints"]),
    "report-writer-warns-every-time": (
        "a report file the disk refuses is said once, then written no more",
        "        self.stopped = True\n        self._log.warning(",
        "        self._log.warning(",
        ["tests/system/test_full_disk.py::test_the_balance_and_validation_logs_stop_once_and_keep_whole_lines"]),
    "half-a-line-kept": (
        "balance.jsonl keeps whole lines when the disk fills mid-line",
        "                os.ftruncate(self._file.fileno(), start)",
        "                pass",
        ["tests/system/test_full_disk.py::test_the_balance_and_validation_logs_stop_once_and_keep_whole_lines"]),
    "tensorboard-close-silent": (
        "TensorBoard events that fail only at close are said once",
        "                self._out.stop(err)",
        "                pass",
        ["tests/system/test_full_disk.py::test_tensorboard_stops_once_when_the_disk_fills"]),
    "save-failure-names-no-resuming-update": (
        "a save the full disk refuses names the checkpoint that resumes and its update",
        '            resumes = "it resumes" + (f" from update {saved}" if saved is not None else "")',
        '            resumes = "it resumes"',
        ["tests/system/test_full_disk.py::test_a_save_the_full_disk_refuses_names_the_disk_and_the_checkpoint_that_resumes"]),
    "copy-failure-blames-the-last-checkpoint": (
        "a copy the full disk refuses names the new checkpoint_last.pt as what resumes",
        "        elif err.path != last:      # a copy",
        "        elif False:      # a copy",
        ["tests/system/test_full_disk.py::test_a_copy_the_full_disk_refuses_names_the_new_last_checkpoint"]),
    "full-disk-unnamed": (
        "a save the full disk refuses names the disk",
        '            return f"Free space on {self.disk} or pass --save-dir on a larger disk"',
        '            return "Free space or pass --save-dir on a larger disk"',
        ["tests/system/test_full_disk.py::test_a_save_the_full_disk_refuses_names_the_disk_and_the_checkpoint_that_resumes"]),
    "save-folder-gone-is-a-traceback": (
        "a save whose folder went away is one line",
        "        if not (full or isinstance(err, OSError) or os_error(err) is not None):",
        "        if not full:",
        ["tests/unit/base/test_full_disk.py::test_a_save_whose_folder_is_gone_is_one_line"]),
    "picture-written-in-place": (
        "hetseq-plot on a full disk keeps the previous picture",
        "        fig.savefig(partial, dpi=100,",
        "        fig.savefig(out, dpi=100,",
        ["tests/system/test_full_disk.py::test_the_picture_on_a_full_disk_is_one_line_and_the_previous_one_stays"]),
    "export-failure-is-a-traceback": (
        "--export-hf on a full disk is one line",
        "            if not write_failed(err):\n                raise",
        "            if True:\n                raise",
        ["tests/system/test_full_disk.py::test_an_export_the_full_disk_refuses_is_one_line"]),
    # ---- issue 58: a checkpoint is checked before it is used ----
    "compressed-record-loaded": (
        "only stored zip records are torch.load'ed (torch.load inflates DEFLATE ones)",
        "        if record.compress_type != zipfile.ZIP_STORED:",
        "        if False:",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_only_stored_records_within_the_archive_are_loaded"]),
    "overlapping-records-loaded": (
        "a zip's records together fit in the archive (none read twice)",
        "    if total > size:",
        "    if False:",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_only_stored_records_within_the_archive_are_loaded"]),
    "peer-bytes-loaded-unchecked": (
        "a peer's bytes are checked as torch.save's before torch.load",
        "        return safe_load.load(tensor.cpu().numpy().tobytes())",
        "        return torch.load(io.BytesIO(tensor.cpu().numpy().tobytes()), weights_only=True)",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_a_peers_compressed_object_is_refused_naming_the_peer"]),
    "read-file-kinds-unchecked": (
        "the kinds declared with a checkpoint's keys are checked wherever a file is read",
        "    try:\n        Component.check_declared(state)\n    except StateMismatch",
        "    try:\n        pass\n    except StateMismatch",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_a_declared_kind_is_checked_wherever_a_file_is_read"]),
    "component-kinds-unchecked": (
        "each checkpoint part is checked against what this run builds, naming the field",
        "                    kind().check(self._kept(name, state[name]), name)",
        "                    pass",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_every_wrong_leaf_of_a_real_checkpoint_is_named_in_one_line",
         "tests/unit/checkpoints/test_checkpoint_checks.py::test_the_fields_of_issue_58_are_named"]),
    "negative-counts-accepted": (
        "a checkpoint's counts and sizes are not negative",
        "        if self.low is not None and not (value > self.low if self.strict else value >= self.low):",
        "        if False:",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_every_wrong_leaf_of_a_real_checkpoint_is_named_in_one_line",
         "tests/unit/checkpoints/test_checkpoint_checks.py::test_the_fields_of_issue_58_are_named"]),
    "optimizer-slot-shape-unchecked": (
        "an optimizer state tensor has its parameter's shape and dtype",
        "Tensor(shape=shape, dtype=dtype) if whole else _count()",
        "ANYTHING if whole else _count()",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_every_wrong_leaf_of_a_real_checkpoint_is_named_in_one_line",
         "tests/unit/checkpoints/test_checkpoint_checks.py::test_the_fields_of_issue_58_are_named"]),
    "rng-unchecked": (
        "the saved RNG states are what this process's generators take",
        "                rng_kind().check(state[RNG], RNG)",
        "                pass",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_every_wrong_leaf_of_a_real_checkpoint_is_named_in_one_line"]),
    "restore-loads-unchecked": (
        "a checkpoint is checked before any part loads, on every rank",
        "        self.check(state, where)\n",
        "",
        ["tests/system/test_checkpoint_checks.py::test_a_crafted_model_value_ends_every_rank_of_a_split_state_with_one_line"]),
    # ---- issue 58: no user-visible tensor points into freed memory ----
    "freed-parameters-view-freed-storage": (
        "outside forward a parameter under --zero 2/3 by memory is its shard or empty, never freed storage",
        "            self._as_shard()\n",
        "",
        ["tests/system/test_parameters_in_loss.py::test_a_loss_reading_every_parameter_updates_as_one_process"]),
    "full-weights-writes-lost-by-memory": (
        "what a task writes in full_weights reaches the shards (by memory)",
        "self.shard.copy_(self.full.data[self.lo:self.hi])",
        "pass",
        ["tests/system/test_parameters_in_loss.py::test_a_loss_reading_every_parameter_updates_as_one_process"]),
    "full-weights-writes-lost-fsdp2": (
        "what a task writes in full_weights reaches the shards (FSDP2)",
        "_write_chunk(param, whole[id(param)])",
        "None",
        ["tests/system/test_parameters_in_loss.py::test_a_loss_reading_every_parameter_updates_as_one_process"]),
    "forward-inside-full-weights-by-memory": (
        "the model run inside full_weights is refused under --zero 2/3",
        "            if self._open:\n                # Leaving would free",
        "            if False:\n                # Leaving would free",
        ["tests/system/test_parameters_in_loss.py::test_a_loss_reading_every_parameter_updates_as_one_process"]),
    "gradient-bytes-of-a-shard": (
        "every rank counts the whole gradient's bytes (the links' probes)",
        "return sum(flat.numel * flat.full.element_size() for flat in self._flats())",
        "return sum(p.numel() * p.element_size() for p in params)",
        ["tests/system/test_parameters_in_loss.py::test_a_loss_reading_every_parameter_updates_as_one_process"]),
    "checkpoint-reads-freed-shapes": (
        "checkpoints of shares by memory take shapes from the units, not freed parameters",
        "zip(flat.params, flat.offsets, flat.numels, flat.shapes)",
        "zip(flat.params, flat.offsets, [p.numel() for p in flat.params], [p.shape for p in flat.params])",
        ["tests/system/test_sharding.py::test_resume_under_another_mode_and_world_equals_an_uninterrupted_run"]),
    # ---- issue 58: sealed store traffic; a salt the listener cannot choose ----
    "frames-authenticated-not-encrypted": (
        "every frame after the handshake is encrypted: a relay between two ranks reads nothing of the job",
        '        return self._aead.encrypt(self._nonce(seq), data, header)\n\n'
        '    def open(self, seq: int, header: bytes, sealed: bytes) -> bytes | None:\n'
        '        """The data of frame ``seq``; None when it fails authentication."""\n'
        '        try:\n'
        '            return self._aead.decrypt(self._nonce(seq), sealed, header)\n',
        '        return data + self._aead.encrypt(self._nonce(seq), b"", header + data)\n\n'
        '    def open(self, seq: int, header: bytes, sealed: bytes) -> bytes | None:\n'
        '        try:\n'
        '            self._aead.decrypt(self._nonce(seq), sealed[-TAG:], header + sealed[:-TAG])\n'
        '            return sealed[:-TAG]\n',
        ["tests/unit/store/test_secret.py::test_a_relay_between_two_ranks_reads_nothing_of_the_job"]),
    "client-stretches-the-listeners-salt": (
        "a client stretches the secret only with its own job id's salt, never one the other end sends",
        "    key, nc = secret.key(), secrets.token_bytes(NONCE)",
        '    key, nc = secret.for_job("id " + ns[:16].hex()).key(), secrets.token_bytes(NONCE)',
        ["tests/unit/store/test_secret.py::test_a_fake_listener_cannot_choose_the_salt"]),
    "gate-stretches-a-clients-bytes": (
        "the gate stretches only the salt it derived itself, never a client's bytes",
        "    nc, proof = reply[:NONCE], reply[NONCE:]\n",
        "    nc, proof = reply[:NONCE], reply[NONCE:]\n"
        '    key = secret.for_job("id " + nc[:16].hex()).key()\n',
        ["tests/unit/store/test_secret.py::test_the_gate_never_stretches_what_a_client_sends"]),
    "secret-salt-not-the-job-id": (
        "the key's salt is the job id of the URL: two job ids, two keys",
        '        return f"id {given}"',
        "        return None",
        ["tests/unit/store/test_secret.py::test_the_key_is_memory_hard_and_salted_with_the_job_id"]),
    "job-id-default-names-the-host": (
        "without a job id the salt is the URL's port, the same through any member's address",
        "    return f\"port {parts.netloc.rpartition(':')[2]}\"",
        '    return f"host {parts.netloc}"',
        ["tests/unit/store/test_secret.py::test_the_key_is_memory_hard_and_salted_with_the_job_id"]),
    "secret-without-cipher-falls-back": (
        "a secret where cryptography cannot be imported stops in one line (exit 2), never authentication only",
        "    cipher.aead()\n    return JobSecret(",
        "    return JobSecret(",
        ["tests/system/test_secret.py::test_a_secret_without_the_cipher_is_one_line_and_no_secret_needs_none"]),
    "encoded-typed-secrets-accepted": (
        "hex, base32 or base64 of printable text, or of counting bytes, is refused",
        "SHAPES = (_few_characters, _runs, _counting, _repeated, _words, _keyboard_walk, _encoded,\n"
        "          _hexspeak)",
        "SHAPES = (_few_characters, _runs, _counting, _repeated, _words, _keyboard_walk,\n"
        "          _hexspeak)",
        ["tests/unit/store/test_secret.py::test_typed_secrets_that_look_long_are_refused"]),
    "hexspeak-accepted": (
        "hexspeak (deadbeefcafebabe) is refused",
        "    if covered >= needed:",
        "    if False:",
        ["tests/unit/store/test_secret.py::test_typed_secrets_that_look_long_are_refused"]),
    "time-based-ids-accepted": (
        "a uuid1 or uuid7 printed without dashes, or a ULID, made in the last two years, is refused",
        "    timed = _time_id(text)\n",
        "    timed = None\n",
        ["tests/unit/store/test_secret.py::test_uuids_typed_or_undashed_and_padding_hold_no_bits",
         "tests/unit/store/test_secret.py::test_time_based_ids_are_refused_and_old_or_future_times_are_drawn_hex"]),
    "launched-nodes-without-the-job-id": (
        "hetseq-launch ends every node's URL with the job id it minted",
        '    url = meeting if job_id is None else f"{meeting}/{job_id}"',
        "    url = meeting",
        ["tests/unit/store/test_secret.py::test_the_launcher_hands_every_node_and_the_viewer_one_minted_job_id"]),
    "status-without-the-job-id": (
        "hetseq-status salts the secret with the job id of the URL it is given",
        "        watch(args, job_secret.read_secret(args.job_secret_file, url=args.url))",
        "        watch(args, job_secret.read_secret(args.job_secret_file))",
        ["tests/system/test_status_viewer.py::test_a_job_with_a_secret_is_read_through_its_gate"]),
    # ---- issue 58, review: crafted checkpoints that passed the kinds ----
    "rng-state-not-tried": (
        "a saved CPU generator state is one a generator takes (not only its shape)",
        "            torch.Generator().set_state(value)",
        "            pass",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::"
         "test_a_generator_state_of_the_right_shape_that_no_generator_takes_is_named"]),
    "sparse-or-overlapping-tensor-accepted": (
        "a checkpoint's tensors are dense, no element stored twice (no sparse, no stride 0)",
        "        if value.layout != torch.strided or _overlaps(value):",
        "        if False:",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::"
         "test_a_sparse_or_expanded_tensor_of_the_right_shape_is_named"]),
    "param-groups-in-any-order": (
        "each optimizer group lists this run's parameter positions in order",
        "                if index != first + j:",
        "                if index in group[\"params\"][:j]:",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_param_groups_must_list_this_runs_positions_in_order"]),
    "archive-opened-twice": (
        "the checkpoint file checked is the file torch.load reads (opened once)",
        "        with open(source, \"rb\") as file:\n            return _load(file)",
        "        check_archive(source)\n"
        "        return torch.load(source, map_location=\"cpu\", weights_only=True)",
        ["tests/unit/checkpoints/test_checkpoint_checks.py::test_the_file_checked_is_the_file_loaded"]),
    "full-weights-yields-freed-storage": (
        "a tensor full_weights yields stays valid however long a task keeps it (never a "
        "view of a unit's storage that freeing releases)",
        "return self.whole(self.shard.detach().to(self.full.device))",
        "self.gather(); return self.full.detach()",
        ["tests/system/test_parameters_in_loss.py::test_weights_kept_past_full_weights_stay_valid"]),
    "freed-view-shares-accumulator": (
        "a gradient reaching a freed parameter (a regulariser on model.parameters() in loss "
        "under --zero 3 by memory) is refused with a UserError saying what to do",
        "    param.data = data.new_empty(0, dtype=other)",
        "    pass",
        ["tests/system/test_parameters_in_loss.py::"
         "test_a_regulariser_outside_forward_under_zero_3_by_memory_is_refused"]),
    "fork-with-threads": (
        "CPU ranks fork from the command only while it has one thread; with more, from "
        "a fork server (a lock held by another thread is never copied)",
        "        if threads_here() == 1:                     # an import may have started one",
        "        if True:",
        ["tests/system/test_startup.py::"
         "test_cpu_ranks_fork_from_the_command_or_a_preloaded_server_and_cuda_ranks_are_spawned"]),
    "forked-rank-keeps-listener": (
        "a rank forked from a node that serves its own store does not keep the store's "
        "listener open",
        "    for fd in not_inherited:\n        os.close(fd)",
        "    for fd in not_inherited:\n        pass",
        ["tests/system/test_startup.py::test_a_nodes_cpu_ranks_are_its_own_children"]),
    "ranks-walk-the-parents-objects": (
        "before CPU ranks fork from the command, its objects go to the collector's "
        "permanent generation",
        "    gc.collect()\n    gc.freeze()\n    try:",
        "    gc.collect()\n    try:",
        ["tests/system/test_startup.py::test_forked_ranks_never_walk_what_their_parent_imported"]),
    "fork-server-keeps-imports-collectable": (
        "the fork server freezes what it imported before it forks ranks",
        "gc.collect()\ngc.freeze()\n",
        "gc.collect()\n",
        ["tests/system/test_startup.py::test_forked_ranks_never_walk_what_their_parent_imported"]),
    "round-settles-early-without-an-expected-member": (
        "a round waits EXPECTED_SETTLE_S, not SETTLE_S, for a member it expects",
        "            settle = EXPECTED_SETTLE_S if expected - ids else SETTLE_S",
        "            settle = SETTLE_S",
        ["tests/system/test_elastic.py::test_a_round_does_not_wait_for_a_member_whose_store_refused"]),
    "a-stop-exits-without-saving": (
        "Ctrl-C or SIGTERM saves a checkpoint at the update the ranks agree on, then exits 130/143",
        "                self._save(epoch if end_of_epoch else None, None)\n                break\n",
        "                break\n",
        ["tests/system/test_stop.py::"
         "test_ctrl_c_saves_the_update_the_ranks_agree_on_and_the_same_command_resumes",
         "tests/system/test_stop.py::test_ctrl_c_on_the_launcher_saves_on_every_node_and_exits_130"]),
    "the-wrapper-kills-before-the-save": (
        "a node's wrapper waits the time its command announced for its save before SIGKILL",
        "time.monotonic() < began + (relay.bound or 0) + STOP_S:",
        "time.monotonic() < began + STOP_S:",
        ["tests/system/test_stop.py::test_the_node_wrapper_waits_the_time_its_command_announced"]),
    "a-second-ctrl-c-waits-too": (
        "a second Ctrl-C (or SIGTERM) stops at once",
        "        if self.received > 1 or values[BOUND] <= 0:",
        "        if values[BOUND] <= 0:",
        ["tests/system/test_stop.py::test_a_second_ctrl_c_stops_at_once"]),
    "a-stop-heard-by-one-node-only": (
        "the ranks agree on a stop through the update's statistics: every node stops",
        "            self._stop = asked[0]\n",
        "            self._stop = asked[0] if self.ctx.is_main else None\n",
        ["tests/system/test_stop.py::"
         "test_a_stop_asked_of_one_node_stops_every_node_after_the_same_update"]),
}
