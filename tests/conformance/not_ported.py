"""Every test in the two TensorRT-LLM files, and why the ones without a case here were not ported.

``TRTLLM_TESTS`` lists each ``TEST_F`` of ``capacitySchedulerTest.cpp`` and ``microBatchSchedulerTest.cpp``
(as ``Suite.Test``); a test in it is either ported (a case's name starts with it) or in ``NOT_PORTED``.
"""

from __future__ import annotations

CROSS_KV = "encoder-decoder models: a second, cross-attention KV cache; bm serves decoder-only causal LMs"
LORA = "LoRA adapters and the PEFT cache's page budget; bm has no LoRA (see issue: LoRA/draft tokens)"
PRIORITY = "request priorities (insertRequestInOrder); bm's requests have no priority, arrival order rules"
DISAGG = "disaggregated serving (requests arriving in DISAGG_GENERATION_INIT with a transferred cache)"
DRAFT = "draft tokens (speculative decoding); bm has no speculative decoding yet"
OVERLAP = (
    "two micro-batches in flight (inflight request ids, pipeline overlap); bm's loop runs one micro-batch "
    "per iteration and never has in-flight requests when it schedules"
)
FORCE_CHUNK = "the FORCE_CHUNK chunking policy; bm has first_come_first_served and equal_progress only"
HAND_SET_REUSE = (
    "sets estimatedReusableTokens on a request by hand and calls the micro-batch scheduler once; in bm the "
    "reused prefix comes only from a real prefix match inside the loop, which this case's requests (no "
    "cached prefix anywhere) cannot produce without adding requests the case does not have"
)
SPLIT_BUDGETS = (
    "drives the capacity stage with no token budget in one iteration and the micro-batch stage with a "
    "15-token budget in the next; the engine loop applies one max_num_tokens to every iteration, and "
    "with 15 the 30-token context of the first iteration would not run as the case needs"
)

NOT_PORTED: dict[str, str] = {
    "CapacitySchedulerTest.SimpleShouldFitWithCrossBlocks": CROSS_KV,
    "CapacitySchedulerTest.SimpleDoesntFitWithCrossBlocks": CROSS_KV,
    "CapacitySchedulerTest.SimpleLoraFitsDuplicateTask": LORA,
    "CapacitySchedulerTest.SimpleLoraDoesntFitDuplicateTask": LORA,
    "CapacitySchedulerTest.DisaggGenInitMaxUtilization": DISAGG,
    "CapacitySchedulerTest.RequestsSortedByPriorities": PRIORITY,
    "CapacitySchedulerTest.SimpleDoesntFitPriorities": PRIORITY,
    "CapacitySchedulerTest.SimpleSurpassMaxNumRequestsWithPriorities": PRIORITY,
    "CapacitySchedulerTest.SimpleDoesntFitAddingNewRequestsMaxUtilizationPriorities": PRIORITY,
    "CapacitySchedulerTest.SimpleDoesntFitMaxUtilizationDraftTokens": DRAFT,
    "MicroBatchSchedulerTest.SimpleWithOverlap": OVERLAP,
    "MicroBatchSchedulerTest.InflightRequestsExcluded": OVERLAP,
    "MicroBatchSchedulerTest.DraftTokensMaxNumTokens": DRAFT,
    "MicroBatchSchedulerTest.GenDraftTokensMaxNumTokens": DRAFT,
    "MicroBatchSchedulerTest.ChunkedContextDraftTokensMaxNumTokens": DRAFT,
    "MicroBatchSchedulerTest.ChunkedContextDraftTokensMaxContextLength": DRAFT,
    "MicroBatchSchedulerTest.DraftTokensGreaterThanChunkSize": DRAFT,
    "MicroBatchSchedulerTest.ReusableTokensReduceComputeBudget": HAND_SET_REUSE,
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextFCFS": HAND_SET_REUSE,
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextFCFS_OverBudgetMultiRequest": HAND_SET_REUSE,
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextEqualProgress": HAND_SET_REUSE,
    "MicroBatchSchedulerTest.ReusableTokensNoChunkingMinCostIsOne": HAND_SET_REUSE,
    "CombinedSchedulerTest.CapacitySchedulerSetsReusableTokensForMicroBatch": SPLIT_BUDGETS,
    "CombinedSchedulerTest.CapacitySchedulerReusableTokensWithChunkedMicroBatch": SPLIT_BUDGETS,
    **{
        f"ContextChunkingTest.{name}": DRAFT
        for name in (
            "DraftTokensDiscard",
            "DraftTokensDiscard2",
            "DraftTokensDiscard3",
            "DraftTokensDiscardDueToTokenCapacity",
            "DraftTokensDiscardDueToMaxContextLength",
            "DraftTokensDiscardAll",
            "DraftTokensDiscardAll2",
            "DraftTokensNoDiscard",
            "DraftTokensNoChunkingDiscardAll",
            "DraftTokensNoChunkingDiscardSome",
            "DraftTokensNoChunkingDiscardNone",
        )
    },
    **{
        f"ForceChunkTest.{name}": FORCE_CHUNK
        for name in (
            "Basic",
            "PromptSmallerThanUnit",
            "ExactUnitSize",
            "MultipleRequests",
            "CapacityLimits",
            "CapacityExactFit",
            "MultiIteration",
            "MultiRequestMultiIteration",
            "CapacityAcrossIterations",
            "FullSchedulerPath",
            "FullSchedulerMultipleRequests",
            "FullSchedulerWithGeneration",
        )
    },
}

TRTLLM_TESTS: tuple[str, ...] = (
    # capacitySchedulerTest.cpp, in file order
    "CapacitySchedulerTest.SimpleShouldFit",
    "CapacitySchedulerTest.SimpleShouldFitWithCrossBlocks",
    "CapacitySchedulerTest.SimpleLoraFitsDuplicateTask",
    "CapacitySchedulerTest.SimpleLoraDoesntFitDuplicateTask",
    "CapacitySchedulerTest.SimpleShouldFitInChunk",
    "CapacitySchedulerTest.SimpleDoesntFitMaxUtilization",
    "CapacitySchedulerTest.DisaggGenInitMaxUtilization",
    "CapacitySchedulerTest.RequestsSortedByPriorities",
    "CapacitySchedulerTest.SimpleDoesntFitPriorities",
    "CapacitySchedulerTest.SimpleDoesntFitMaxUtilizationInChunk",
    "CapacitySchedulerTest.SimpleDoesntFitMaxUtilizationInChunkedCache",
    "CapacitySchedulerTest.SimpleDoesntFitMaxUtilizationDraftTokens",
    "CapacitySchedulerTest.SimpleDoesntFitGuaranteedCompletion",
    "CapacitySchedulerTest.SimpleDoesntFitWithCrossBlocks",
    "CapacitySchedulerTest.SimpleDoesntFitGuaranteedCompletionInChunk",
    "CapacitySchedulerTest.SimpleDoesntFitAddingNewRequestsMaxUtilization",
    "CapacitySchedulerTest.SimpleSurpassMaxNumRequestsWithPriorities",
    "CapacitySchedulerTest.SimpleDoesntFitAddingNewRequestsMaxUtilizationPriorities",
    "CapacitySchedulerTest.SimpleDoesntFitAddingNewRequestsGuaranteedCompletion",
    "CapacitySchedulerTest.SimpleDoesntFitAddingNewRequestsGuaranteedCompletionInChunk",
    "CapacitySchedulerTest.DelayDuplicateRequest",
    "CapacitySchedulerTest.DelayDuplicateRequestChunked",
    "CapacitySchedulerTest.DelayFiveRequestsComplicated",
    "CapacitySchedulerTest.SimpleFitsStaticBatch",
    "CapacitySchedulerTest.ReuseAwareSchedulingAllowsMoreRequestsWithSharedPrefix",
    "CapacitySchedulerTest.ReuseAwareSchedulingWithPartialPrefixMatch",
    "CapacitySchedulerTest.NoReuseWithDifferentPrompts",
    "CapacitySchedulerTest.ReuseAwareSchedulingMaxUtilizationPolicy",
    "CapacitySchedulerTest.MaxUtilizationReuseReducesNeededBlocksOneStep",
    "CapacitySchedulerTest.MaxUtilizationUnderMemoryPressureWithReuse",
    "CapacitySchedulerTest.MaxUtilizationMultipleRequestsIncrementalReuse",
    "CapacitySchedulerTest.MaxUtilizationNoReuseWhenDisabled",
    # microBatchSchedulerTest.cpp, in file order
    "MicroBatchSchedulerTest.SimpleNoOverlap",
    "MicroBatchSchedulerTest.SimpleNoOverlapMaxNumTokens",
    "MicroBatchSchedulerTest.SimpleNoOverlapMaxContextLength",
    "MicroBatchSchedulerTest.SimpleWithOverlap",
    "MicroBatchSchedulerTest.SimpleMaxNumTokensBW1",
    "MicroBatchSchedulerTest.SimpleMaxNumTokensBW4",
    "MicroBatchSchedulerTest.DraftTokensMaxNumTokens",
    "MicroBatchSchedulerTest.GenDraftTokensMaxNumTokens",
    "MicroBatchSchedulerTest.ChunkedContextDraftTokensMaxNumTokens",
    "MicroBatchSchedulerTest.ChunkedContextDraftTokensMaxContextLength",
    "MicroBatchSchedulerTest.DraftTokensGreaterThanChunkSize",
    "MicroBatchSchedulerTest.ReusableTokensReduceComputeBudget",
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextFCFS",
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextFCFS_OverBudgetMultiRequest",
    "MicroBatchSchedulerTest.ReusableTokensWithChunkedContextEqualProgress",
    "MicroBatchSchedulerTest.ReusableTokensZeroHasNoEffect",
    "MicroBatchSchedulerTest.ReusableTokensNoChunkingMinCostIsOne",
    "MicroBatchSchedulerTest.BeamWidthMismatchSkipped",
    "MicroBatchSchedulerTest.InflightRequestsExcluded",
    "MicroBatchSchedulerTest.ChunkSizeZeroNotScheduled",
    "CombinedSchedulerTest.CapacitySchedulerSetsReusableTokensForMicroBatch",
    "CombinedSchedulerTest.CapacitySchedulerReusableTokensWithChunkedMicroBatch",
    "CombinedSchedulerTest.NoReuseMicroBatchUnchanged",
    "ContextChunkingTest.NoLimit",
    "ContextChunkingTest.ContextLengthNeverSatisfied",
    "ContextChunkingTest.ChunkLongerThanContext",
    "ContextChunkingTest.ContextLengthSatisfied",
    "ContextChunkingTest.TokenCapacitySmallerThanContext",
    "ContextChunkingTest.TokenCapacitySmallerThanChunkUnit",
    "ContextChunkingTest.SchedulingOrder",
    "ContextChunkingTest.CompletionOrder",
    "ContextChunkingTest.LongFirstShortLater",
    "ContextChunkingTest.FrontPriority",
    "ContextChunkingTest.DraftTokensDiscard",
    "ContextChunkingTest.DraftTokensDiscard2",
    "ContextChunkingTest.DraftTokensDiscard3",
    "ContextChunkingTest.DraftTokensDiscardDueToTokenCapacity",
    "ContextChunkingTest.DraftTokensDiscardDueToMaxContextLength",
    "ContextChunkingTest.DraftTokensDiscardAll",
    "ContextChunkingTest.DraftTokensDiscardAll2",
    "ContextChunkingTest.DraftTokensNoDiscard",
    "ContextChunkingTest.DraftTokensNoChunkingDiscardAll",
    "ContextChunkingTest.DraftTokensNoChunkingDiscardSome",
    "ContextChunkingTest.DraftTokensNoChunkingDiscardNone",
    "ForceChunkTest.Basic",
    "ForceChunkTest.PromptSmallerThanUnit",
    "ForceChunkTest.ExactUnitSize",
    "ForceChunkTest.MultipleRequests",
    "ForceChunkTest.CapacityLimits",
    "ForceChunkTest.CapacityExactFit",
    "ForceChunkTest.MultiIteration",
    "ForceChunkTest.MultiRequestMultiIteration",
    "ForceChunkTest.CapacityAcrossIterations",
    "ForceChunkTest.FullSchedulerPath",
    "ForceChunkTest.FullSchedulerMultipleRequests",
    "ForceChunkTest.FullSchedulerWithGeneration",
)
