#!/usr/bin/env bash
# Model-checks ownership.pml, sequences.pml and moves.pml with spin: every property
# that must hold, and every weakened protocol that must produce a
# counterexample. Prints states explored, depth and time per check; exits
# non-zero on any surprise. MEMLIM (megabytes, default 8192) caps what one
# search may use. ./check.sh: both models; ./check.sh bounds: the
# ownership bounds; ./check.sh groups: the ownership model's capability
# group checks alone; ./check.sh slowparts: its checks of the slow parts
# (issue 39: a lagging watch, tasks claimed ahead, an open transaction)
# alone; ./check.sh sequences: the sequence model alone; ./check.sh moves:
# the model of a shard's move between databases (issue 40) alone.
set -euo pipefail
cd "$(dirname "$0")"
command -v spin >/dev/null || { echo "spin is not installed: apt-get install spin"; exit 1; }
command -v gcc >/dev/null || { echo "gcc is not installed: apt-get install gcc"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Interrupted (Ctrl-C, a CI timeout): still remove the work dir, via EXIT.
trap 'exit 130' INT TERM
cp ownership.pml sequences.pml moves.pml "$work/"
failed=0
printf '%-52s %-23s %-23s %12s %6s %8s  %s\n' check expect result states depth seconds parameters

# The model the checks that follow are of.
pml=ownership.pml

# run NAME EXPECT "SPIN -D FLAGS" "CC FLAGS" "PAN FLAGS", on $pml. EXPECT is
# holds, fails (any counterexample), or fails:PROPERTY (a counterexample
# of that assertion, or "acceptance" for an LTL property: another one is
# a surprise, reported as fails:WHAT).
run() {
	local name=$1 expect=$2 defs=$3 cflags=$4 panflags=$5
	(
		cd "$work"
		rm -f pan pan.* ./*.trail
		spin -a $defs $pml >/dev/null
		gcc -O2 -w -DMEMLIM="${MEMLIM:-8192}" $cflags -o pan pan.c
		./pan -m10000000 $panflags > "$name.out" 2>&1 || true
	)
	local out="$work/$name.out"
	local errors states depth secs result what
	errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | tail -1)
	states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$out" | tail -1)
	depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$out" | tail -1)
	secs=$(sed -n 's/.*elapsed time \([0-9.e+]*\) seconds.*/\1/p' "$out" | tail -1)
	# A search cut short (out of memory, or too deep) proves nothing either
	# way, whatever the error count says.
	if grep -qE "out of memory|memory limit|pan: reached -DMEMLIM" "$out"; then
		result=incomplete
	elif grep -q "max search depth too small" "$out" && [ "$expect" = holds ]; then
		result=truncated
	elif [ "${errors:-1}" = 0 ]; then
		result=holds
	else
		result=fails
		if [[ $expect == fails:* ]]; then
			# What failed: an assertion (named by its variable), an
			# acceptance cycle, or an invalid end state (a deadlock).
			what=$(sed -n 's/^pan:1: assertion violated \([A-Za-z]*\).*/\1/p' "$out" | head -1)
			grep -q "^pan:1: acceptance cycle" "$out" && what=acceptance
			grep -q "^pan:1: invalid end state" "$out" && what=invalid_end_state
			result=fails:${what:-?}
		fi
	fi
	printf '%-52s %-23s %-23s %12s %6s %8s  %s\n' "$name" "$expect" "$result" "${states:-?}" "${depth:-?}" "${secs:-?}" "$defs"
	if [ "$result" != "$expect" ]; then
		failed=1
		echo "---- $name: expected $expect, got $result"
		tail -30 "$out"
	fi
	if [[ $result == fails* ]] && [ "$result" = "$expect" ]; then
		# Keep the (shortest, breadth-first) counterexample as evidence.
		local at trace="traces/${name//[^A-Za-z0-9_.+-]/_}.txt"
		at=$(sed -n 's/.*(at depth \([0-9]*\)).*/\1/p' "$out" | head -1)
		mkdir -p traces
		if [ "$pml" = sequences.pml ] || [ "$pml" = moves.pml ]; then
			# The model narrates its steps (printf): the transactions,
			# their locks and the layout after each commit.
			{
				echo "# $name: $(grep -m1 -E 'assertion violated|acceptance cycle|invalid end state' "$out")"
				echo "# spin -T -t $defs $pml: the steps of the shortest counterexample"
				(cd "$work" && spin -T -t $defs $pml 2>/dev/null) | sed -n '/^start$/,/^spin: trail ends/p'
			} > "$trace"
		else
			# A liveness counterexample comes from the nested depth-first
			# search: a run into a cycle, not the shortest one.
			local which="the shortest counterexample"
			[ "$result" = fails:acceptance ] && which="a counterexample (a run and the cycle it repeats; depth-first, not the shortest)"
			{
				echo "# $name: $(grep -m1 -E 'assertion violated|acceptance cycle' "$out")"
				echo "# spin -t -p $defs $pml, statements of $which"
				echo "# proc 0: clock; proc 1: init; proc 2+2i: network(i); proc 3+2i: worker(i); then session (OPEN_TX)"
				(cd "$work" && spin -t -p -g $defs $pml 2>/dev/null) | grep -E '^ *[0-9]+:' | sed "s/$pml:[0-9]* //"
			} > "$trace"
		fi
		echo "    counterexample: ${at:-?} steps, trace in model/$trace"
	fi
}

# Breadth-first: a complete search with no depth limit for what must hold,
# and the shortest counterexample for what must fail.
holds="-DNOCLAIM -DSAFETY -DCOLLAPSE -DBFS"
fails="$holds"

if [ "${1:-}" = "" ]; then
# One group of two runners (GROUPS 0).
# The protocol as built, with a slow clock: safety properties in every state.
run NoDoubleExecution+NoStaleWrite+OutcomeOnce holds "-DTTL=4 -DMARGIN=2 -DLAG=1" "$holds" "-E"
# A pause as long as the margin: still safe.
run ...pause_equal_to_margin                   holds "-DTTL=4 -DMARGIN=2 -DPAUSE=2" "$holds" "-E"
# An operator detaching and attaching each runner.
run ...manual_detach_and_attach                holds "-DTTL=4 -DMARGIN=2 -DMANUAL=1" "$holds" "-E"
# A pause longer than the margin: execution may overlap (the documented
# at-least-once limit) ...
run NoDoubleExecution_pause_over_margin        fails:NoDoubleExecution "-DTTL=4 -DMARGIN=2 -DPAUSE=3" "$fails" "-E"
# ... and in that same setting the fence still refuses every stale write,
# and there is still one outcome.
run NoStaleWrite+OutcomeOnce_pause_over_margin holds "-DTTL=4 -DMARGIN=2 -DPAUSE=3 -DNO_DOUBLE_EXEC_CHECK" "$holds" "-E"
# The overlap needs work that was running when the pause began: new work
# never overlaps, whatever the pause, because claims check the lease clock.
run NoDoubleExecution_idle_pause_over_margin   holds "-DTTL=4 -DMARGIN=2 -DPAUSE=3 -DIDLE_PAUSE=1" "$holds" "-E"
# Progress: no faults, keep-alives on schedule, weak fairness.
run Progress                                   holds "-DTTL=4 -DMARGIN=2 -DFAULTS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"

# Weakened protocols must produce counterexamples.
run weakened:margin_0_slow_clock               fails:NoDoubleExecution "-DTTL=4 -DMARGIN=0 -DLAG=1" "$fails" "-E"
# (the bug needs a response delayed by more than the margin while the runner
# is still attached: MARGIN < delay < TTL - MARGIN - 1, so TTL 5, MARGIN 1)
run weakened:deadline_from_receipt             fails:NoDoubleExecution "-DTTL=5 -DMARGIN=1 -DRECEIPT_BUG=1" "$fails" "-E"
run weakened:raise_and_requeue_apart          fails:NoStaleWrite "-DTTL=4 -DMARGIN=2 -DPAUSE=3 -DSPLIT_RAISE=1 -DNO_DOUBLE_EXEC_CHECK" "$fails" "-E"
run weakened:claim_without_fence_lock          fails:NoStaleWrite "-DTTL=4 -DMARGIN=2 -DCLAIM_NOLOCK=1 -DNO_DOUBLE_EXEC_CHECK" "$fails" "-E"
# (NoStartPastDetach fails first, below: checked off here, so that the
# counterexample is the overlap itself)
run weakened:claim_without_lease_clock         fails:NoDoubleExecution "-DTTL=4 -DMARGIN=2 -DPAUSE=3 -DIDLE_PAUSE=1 -DCLAIM_NO_CLOCK=1 -DNO_START_CHECK" "$fails" "-E"
run weakened:claim_without_lease_clock_start   fails:NoStartPastDetach "-DTTL=4 -DMARGIN=2 -DPAUSE=3 -DIDLE_PAUSE=1 -DCLAIM_NO_CLOCK=1" "$fails" "-E"
fi

if [ "${1:-}" = "" ] || [ "${1:-}" = groups ]; then
# Capability groups (GROUPS 1): runners 0 and 1 form group A, runner 2
# group B; task 0 only A can run, task 1 both (a lane both claim from).
# Each unit (group, shard) has its owner keys and its fence. Three timed
# runners with every fault are too many states: each check below gives
# the faults to the runners it names (FAULTY, a bit mask), the others keep
# their keep-alives on schedule; no slow clock (LAG is per runner, checked
# above).
g="-DGROUPS=1 -DTTL=4 -DMARGIN=2"
# Group A's runner 0 loses and delays keep-alives: A's unit changes hands
# (lease expiry, release) while B runs the shared lane.
run groups:safety_A_keepalives                  holds "$g -DFAULTY=1" "$holds" "-E"
# The same for group B's runner, in this subset and make model-bounds.
if [ "${1:-}" = groups ]; then
run groups:safety_B_keepalives                  holds "$g -DFAULTY=4" "$holds" "-E"
fi
# An operator detaches and attaches runner 0 (no keep-alive faults).
run groups:manual_detach_and_attach_A           holds "$g -DFAULTY=1 -DMANUAL=1 -DKA_FAULTS=0" "$holds" "-E"
# Runner 0 frozen beyond the margin (keep-alives lost, not delayed): its
# late writes are refused by its unit's fence, whatever B does.
run groups:NoStaleWrite+OutcomeOnce_pause_over_margin_A holds "$g -DFAULTY=1 -DPAUSE=3 -DDELAYS=0 -DNO_DOUBLE_EXEC_CHECK" "$holds" "-E"
# Progress: no faults, weak fairness; every task completed ...
run groups:Progress                             holds "$g -DFAULTS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# ... and with group A stopped, the task B can run.
run groups:Progress_B_alone                     holds "$g -DFAULTS=0 -DONLY_B=1" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# Weakened group protocols: no fault is needed for any of them.
run groups:weakened:acquire_on_own_key_only     fails:NoDoubleExecution "$g -DFAULTS=0 -DOWN_KEY_ONLY=1" "$fails" "-E"
run groups:weakened:one_fence_per_shard         fails:NoDoubleExecution "$g -DFAULTS=0 -DSHARED_FENCE=1" "$fails" "-E"
# B claims with no unit of its own: its write lands under no fence of its
# unit ...
run groups:weakened:claim_without_own_unit      fails:NoStaleWrite "$g -DFAULTS=0 -DCLAIM_UNOWNED=1" "$fails" "-E"
# ... and its raise, when it acquires the unit, requeues what it runs.
run groups:weakened:claim_without_own_unit_overlap fails:NoDoubleExecution "$g -DFAULTS=0 -DCLAIM_UNOWNED=1 -DNO_STALE_WRITE_CHECK" "$fails" "-E"
run groups:weakened:claim_lanes_of_other_kinds  fails:RunsWhereItCan "$g -DFAULTS=0 -DCLAIM_ANY_KIND=1" "$fails" "-E"
fi

if [ "${1:-}" = "" ] || [ "${1:-}" = slowparts ]; then
# The slow parts (issue 39), in the one-group model: two runners of one
# group, one shard.
s="-DTTL=4 -DMARGIN=2"
# A lagging watch (WATCH): each runner's view of the other member's owner
# key comes from its watch, late, several events at once, in batches whose
# header is etcd's current revision; one other write under the prefix.
# Runner 0 loses and delays keep-alives (its unit changes hands by expiry
# and release) while both watches lag: no two keys name the unit, and the
# rest holds.
run slow:watch:OneNamer+safety_A_keepalives    holds "$s -DWATCH=1 -DFAULTY=1" "$holds" "-E"
run slow:watch:Progress                        holds "$s -DWATCH=1 -DFAULTS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# Before the fix: groupRev from the batch's header. No fault is needed.
run slow:watch:weakened:header_revision        fails:OneNamer "$s -DWATCH=1 -DFAULTS=0 -DHEADER_REV=1" "$fails" "-E"
# ... and what follows from it: the two holders run the task at once.
run slow:watch:weakened:header_revision_overlap fails:NoDoubleExecution "$s -DWATCH=1 -DFAULTS=0 -DHEADER_REV=1 -DNO_ONE_NAMER_CHECK" "$fails" "-E"
# ... though the fence refuses the lower epoch's writes: one outcome.
run slow:watch:weakened:header_revision_writes holds "$s -DWATCH=1 -DFAULTS=0 -DHEADER_REV=1 -DNO_ONE_NAMER_CHECK -DNO_DOUBLE_EXEC_CHECK" "$holds" "-E"
# Tasks claimed ahead (AHEAD): a pause beyond the margin that begins while
# the runner runs nothing but may hold tasks in its buffer (keep-alives
# lost, not delayed) ...
run slow:ahead:idle_pause_over_margin          holds "$s -DAHEAD=1 -DPAUSE=3 -DIDLE_PAUSE=1 -DDELAYS=0" "$holds" "-E"
# ... a slow clock ...
run slow:ahead:slow_clock                      holds "$s -DAHEAD=1 -DLAG=1 -DDELAYS=0" "$holds" "-E"
# (no give-back for patience: it comes after ten times the expected wait,
# so it does not repeat forever)
run slow:ahead:Progress                        holds "$s -DAHEAD=1 -DFAULTS=0 -DPATIENCE=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# Before the fix: a buffered task starts unless its term's context ended.
# The woken runner starts it past its detach point ...
run slow:ahead:weakened:start_unchecked        fails:NoStartPastDetach "$s -DAHEAD=1 -DPAUSE=3 -DIDLE_PAUSE=1 -DDELAYS=0 -DAHEAD_NO_CHECK=1" "$fails" "-E"
# ... while the next owner runs the task it requeued ...
run slow:ahead:weakened:start_unchecked_overlap fails:NoDoubleExecution "$s -DAHEAD=1 -DPAUSE=3 -DIDLE_PAUSE=1 -DDELAYS=0 -DAHEAD_NO_CHECK=1 -DNO_START_CHECK" "$fails" "-E"
# ... but its writes are still refused and there is one outcome.
run slow:ahead:weakened:start_unchecked_writes holds "$s -DAHEAD=1 -DPAUSE=3 -DIDLE_PAUSE=1 -DDELAYS=0 -DAHEAD_NO_CHECK=1 -DNO_START_CHECK -DNO_DOUBLE_EXEC_CHECK" "$holds" "-E"
# A handler's transaction holding its claim row (OPEN_TX: two tasks). Its
# runner may freeze for good with it open (keep-alives lost, not delayed):
# the raise skips the row and the transaction ends (commit, or rollback
# after its bound) ...
run slow:open_tx:safety_freeze                 holds "$s -DOPEN_TX=1 -DFREEZE=1 -DDELAYS=0" "$holds" "-E"
# ... runner 0 paused beyond the margin with it open: its late writes are
# refused (NoDoubleExecution not checked: the at-least-once limit) ...
run slow:open_tx:NoStaleWrite+OutcomeOnce_pause_A holds "$s -DOPEN_TX=1 -DFAULTY=1 -DPAUSE=3 -DNO_DOUBLE_EXEC_CHECK" "$holds" "-E"
# ... every task completes once the bound ends the transaction ...
run slow:open_tx:Progress                      holds "$s -DOPEN_TX=1 -DFREEZE=1 -DFAULTS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# ... and with it open forever, every other task.
run slow:open_tx:OthersProgress                holds "$s -DOPEN_TX=1 -DTX_FOREVER=1 -DFREEZE=1 -DFAULTS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N OthersProgress"
# Before the fix: the raise waits for the locked row. Nothing else moves.
run slow:open_tx:weakened:raise_waits_for_locks fails:acceptance "$s -DOPEN_TX=1 -DTX_FOREVER=1 -DFREEZE=1 -DFAULTS=0 -DWAIT_LOCKS=1" "-DCOLLAPSE -DNFAIR=3" "-a -f -N OthersProgress"
# ... which only the transaction open forever tells from slow: with it
# bounded, the old raise also gets there.
run slow:open_tx:weakened:raise_waits_bounded  holds "$s -DOPEN_TX=1 -DFREEZE=1 -DFAULTS=0 -DWAIT_LOCKS=1" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# A row the raise skipped outlives it: writes must read the fence.
run slow:open_tx:weakened:writes_without_fence_read fails:NoStaleWrite "$s -DOPEN_TX=1 -DFAULTY=1 -DPAUSE=3 -DNO_DOUBLE_EXEC_CHECK -DWRITE_FENCE=0" "$fails" "-E"
fi

if [ "${1:-}" = "" ] || [ "${1:-}" = sequences ]; then
# The sequence protocol (sequences.pml). No -E: a state where every actor
# waits is an invalid end state, besides NoDeadlock's assertion.
pml=sequences.pml
# As built, every safety property in every state: two failed attempts in
# all (one retried, one for good), two operator actions, retention.
run sequences:safety                               holds "-DFAILS=1 -DFINALS=1 -DOPS=2" "$holds" ""
# More failures, one operator action.
run sequences:safety_more_failures                 holds "-DFAILS=2 -DFINALS=2 -DOPS=1" "$holds" ""
# Progress: retried failures, nothing for good, no operator; weak fairness.
run sequences:Progress                             holds "-DFAILS=2 -DFINALS=0 -DOPS=0" "-DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"

# Weakened protocols (before the fix of issue 32, and before c7a8b42):
# each must fail, on the property named.
# The cancel looks before its locks: a waiting task promoted meanwhile is
# cancelled in its lane ...
run sequences:weakened:cancel_looks_first          fails:Layout "-DCANCEL_LOOK_FIRST=1 -DFAILS=0" "$fails" ""
# ... or claimed meanwhile, cancelled while it runs, and the next task of
# its sequence becomes claimable beside it ...
run sequences:weakened:cancel_looks_first_claimed  fails:OneRunnable "-DCANCEL_LOOK_FIRST=1 -DFAILS=0 -DOPS=1 -DNO_LAYOUT_CHECK" "$fails" ""
# ... or a running head requeued meanwhile gets a request, in its lane.
run sequences:weakened:cancel_looks_first_requeue  fails:Layout "-DCANCEL_LOOK_FIRST=1" "$fails" ""
run sequences:weakened:retention_deletes_heads     fails:Headed "-DRETENTION_DELETES_HEADS=1 -DNO_LAYOUT_CHECK" "$fails" ""
run sequences:weakened:settle_in_task_id_order     fails:NoDeadlock "-DSETTLE_BY_ID=1" "$fails" ""
run sequences:weakened:retry_sequence_before_key   fails:NoDeadlock "-DRETRY_SEQUENCE_FIRST=1" "$fails" ""
run sequences:weakened:promote_in_id_order         fails:InOrder "-DPROMOTE_BY_ID=1" "$fails" ""
fi

if [ "${1:-}" = "" ] || [ "${1:-}" = moves ]; then
# A shard's move between databases (moves.pml, issue 40). No -E: a state
# where every actor waits is an invalid end state (deadlock-freedom).
# Compiled -O0: the narration makes pan.c large, and gcc -O2 spends half a
# minute on it for a search of a second or two.
pml=moves.pml
mholds="-O0 $holds"
mfails="-O0 $fails"
# As designed, with recovery resuming at the leave (the design's text
# resumes at the copy: below): every safety property in every state,
# the driver crashing twice at any point
# (each crash: a new driver recovers, resuming or rolling back) ...
run moves:safety                                   holds "" "$mholds" ""
# ... four times.
run moves:safety_four_crashes                      holds "-DCRASHES=4" "$mholds" ""
# Progress: the move ends and every task completes (weak fairness).
run moves:Progress                                 holds "" "-O0 -DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# A new owner takes the shard over during the move (its raise lands
# wherever the map sent it): the old owner's writes are refused.
run moves:owner_change                             holds "-DRAISE=1 -DCOPY_LOCKS_FENCE=1" "$mholds" ""
# The driver paused with its transaction open while a new leader's driver
# recovers, its statements under the coordinator fence of each database
# and its etcd steps comparing the leader key ...
run moves:paused_driver_leader_fence               holds "-DZOMBIE=1 -DLEADER_FENCE=1" "$mholds" ""
# ... and the move still ends (no other crash: with one, 16 s).
run moves:paused_driver_leader_fence_Progress      holds "-DZOMBIE=1 -DLEADER_FENCE=1 -DCRASHES=0" "-O0 -DCOLLAPSE -DNFAIR=3" "-a -f -N Progress"
# A producer in REPEATABLE READ, its trigger reading the placement row
# FOR SHARE.
run moves:producer_repeatable_read_for_share       holds "-DPRODUCER_RR=1 -DPLACEMENT_FOR_SHARE=1" "$mholds" ""

# The design's text where it differs from the above: each a counterexample.
# Recovery resumes at the copy whatever A's placement: after a crash
# between the intent and the leave, the copy runs while A is held ...
run moves:design:resume_at_copy                    fails:NoClaimAfterCopy "-DRESUME_AT_COPY=1" "$mfails" ""
# ... and a producer's insert lands at A after the copy read.
run moves:design:resume_at_copy_producer           fails:ProducerNeverWritesAtAAfterLeave "-DRESUME_AT_COPY=1 -DNO_CLAIM_CHECK" "$mfails" ""
# A producer's REPEATABLE READ snapshot older than the leave passes the
# trigger's check.
run moves:design:producer_repeatable_read          fails:ProducerNeverWritesAtAAfterLeave "-DPRODUCER_RR=1" "$mfails" ""
# A raise between the copy's read and its commit is lost: B has the old
# epoch.
run moves:design:owner_change_during_copy          fails:NoStaleWrite "-DRAISE=1" "$mfails" ""
# A paused driver and a new one, unfenced: the old one, waking, finishes
# its rollback and removes the intent while the new one resumes ...
run moves:design:paused_driver                     fails:EndsSettled "-DZOMBIE=1" "$mfails" ""
# ... or commits its copy's step 4 after the new one deleted B's copy.
run moves:design:paused_driver_loss                fails:NoLoss "-DZOMBIE=1 -DNO_SETTLED_CHECK -DNO_CLAIM_CHECK" "$mfails" ""
# Fenced in the databases, but its etcd steps comparing the move's
# revision only: the old driver's rollback removes the intent while the
# new one resumes; the new one commits, and N is left gone at A, arriving
# at B, the map naming A.
run moves:design:paused_driver_etcd_cas_only       fails:EndsSettled "-DZOMBIE=1 -DLEADER_FENCE=1 -DETCD_CAS_ONLY=1" "$mfails" ""

# Weakened protocols: each must fail, on the property named.
run moves:weakened:no_producer_lock                fails:ProducerNeverWritesAtAAfterLeave "-DNO_PRODUCER_LOCK=1" "$mfails" ""
run moves:weakened:no_producer_lock_loss           fails:NoLoss "-DNO_PRODUCER_LOCK=1 -DNO_PRODUCER_CHECK" "$mfails" ""
run moves:weakened:copy_without_claim_locks        fails:OneOutcome "-DCOPY_WITHOUT_CLAIM_LOCKS=1" "$mfails" ""
run moves:weakened:switch_before_commit            fails:OneOutcome "-DSWITCH_BEFORE_COMMIT=1" "$mfails" ""
run moves:weakened:switch_before_commit_rerun      fails:NoDoubleRun "-DSWITCH_BEFORE_COMMIT=1 -DNO_OUTCOME_CHECK" "$mfails" ""
run moves:weakened:gone_is_fence_lost              fails:NoDoubleRun "-DGONE_IS_FENCE_LOST=1" "$mfails" ""
run moves:weakened:no_moving_fence                 fails:NoClaimAfterCopy "-DNO_MOVING_FENCE=1" "$mfails" ""
run moves:weakened:no_moving_fence_outcome         fails:OneOutcome "-DNO_MOVING_FENCE=1 -DNO_CLAIM_CHECK" "$mfails" ""
run moves:weakened:no_moving_fence_rerun           fails:NoDoubleRun "-DNO_MOVING_FENCE=1 -DNO_CLAIM_CHECK -DNO_OUTCOME_CHECK" "$mfails" ""
run moves:weakened:recover_by_phase                fails:NoLoss "-DRECOVER_BY_PHASE=1" "$mfails" ""
fi

if [ "${1:-}" = bounds ]; then
# The bound, at its edges (slower: make model-bounds): holds while
# LAG + PAUSE <= MARGIN, fails beyond.
run bound:lag1+pause1=margin2                  holds "-DTTL=4 -DMARGIN=2 -DLAG=1 -DPAUSE=1" "$holds" "-E"
run bound:lag1+pause2                          fails:NoDoubleExecution "-DTTL=4 -DMARGIN=2 -DLAG=1 -DPAUSE=2" "$fails" "-E"
run bound:lag1=margin1                         holds "-DTTL=4 -DMARGIN=1 -DLAG=1" "$holds" "-E"
run bound:pause1=margin1                       holds "-DTTL=3 -DMARGIN=1 -DPAUSE=1" "$holds" "-E"
run bound:three_acquisitions                   holds "-DTTL=4 -DMARGIN=2 -DLAG=1 -DMAXACQ=3" "$holds" "-E"
# With capability groups: a pause as long as the margin on group A's
# runner 0 (keep-alives lost, not delayed) ...
run bound:groups_pause2=margin2_A              holds "-DGROUPS=1 -DTTL=4 -DMARGIN=2 -DFAULTY=1 -DPAUSE=2 -DDELAYS=0" "$holds" "-E"
# ... and group B's runner losing and delaying keep-alives: B's unit
# changes epoch while A runs (the mirror of groups:safety_A_keepalives).
run bound:groups_safety_B_keepalives           holds "-DGROUPS=1 -DTTL=4 -DMARGIN=2 -DFAULTY=4" "$holds" "-E"
fi

if [ $failed != 0 ]; then
	echo "model check: unexpected results"
	exit 1
fi
echo "model check: all as expected"
