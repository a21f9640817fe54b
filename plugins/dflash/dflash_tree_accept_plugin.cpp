/*
 * TensorRT IPluginV3 wrapper of the draft trees' acceptance (README.md §Draft trees): plugin `DFlashTreeAccept`,
 * around launchDFlashTreeAccept. Same structure as dflash_accept_plugin.cpp; no attributes (the tree's size comes
 * from the shapes). Its creator is in dflash_accept_creator.cpp.
 */
#include "dflash_accept_kernel.h"
#include "plugin_common.h"
#include "dflash_accept_plugin.h"

#include <exception>
#include <memory>

using namespace nvinfer1;

namespace trtllm_dflash
{
namespace
{

enum Input : int32_t
{
    kTargetLogits = 0, // float32 | float16 | bfloat16 [B, N, V]
    kTemperature = 1,  // float32 [B]
    kGumbelNoise = 2,  // float32 [B, N, V]
    kTreeParents = 3,  // int32 [B, N]
    kTreeTokens = 4,   // int32 [B, N]
    kNbInputs = 5,
};

enum Output : int32_t
{
    kPathNodes = 0,  // int32 [B, N]
    kPathLength = 1, // int32 [B]
    kBonus = 2,      // int32 [B]
    kNbOutputs = 3,
};

} // namespace

std::string DFlashTreeAcceptPlugin::shapeError(Dims const* dims)
{
    int32_t const ranks[kNbInputs] = {3, 1, 3, 2, 2};
    char const* const names[kNbInputs] = {"target_logits", "temperature", "gumbel_noise", "tree_parents", "tree_tokens"};
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        if (dims[i].nbDims != ranks[i])
        {
            return std::string(names[i]) + " must have rank " + std::to_string(ranks[i]) + ", got shape "
                + dimsToString(dims[i]);
        }
        if (!sameOrUnknown(dims[i].d[0], dims[kTargetLogits].d[0]))
        {
            return std::string(names[i]) + " has batch " + std::to_string(dims[i].d[0]) + ", target_logits has "
                + std::to_string(dims[kTargetLogits].d[0]);
        }
    }
    Dims const& logits = dims[kTargetLogits];
    for (int32_t i : {kTreeParents, kTreeTokens})
    {
        if (!sameOrUnknown(dims[i].d[1], logits.d[1]))
        {
            return std::string(names[i]) + " " + dimsToString(dims[i]) + " must have one entry per node of target_logits "
                + dimsToString(logits);
        }
    }
    Dims const& noise = dims[kGumbelNoise];
    if (!sameOrUnknown(noise.d[1], logits.d[1]) || !sameOrUnknown(noise.d[2], logits.d[2]))
    {
        return "gumbel_noise " + dimsToString(noise) + " must have the shape of target_logits " + dimsToString(logits);
    }
    if (logits.d[1] == 0 || logits.d[1] > kDFlashMaxBlockSize)
    {
        return "a tree of " + std::to_string(logits.d[1]) + " nodes is outside 1.." + std::to_string(kDFlashMaxBlockSize);
    }
    if (logits.d[2] == 0 || logits.d[2] > kDFlashMaxVocabSize)
    {
        return "vocabulary size " + std::to_string(logits.d[2]) + " is outside 1.."
            + std::to_string(kDFlashMaxVocabSize);
    }
    return {};
}

template <typename InputDims>
int32_t DFlashTreeAcceptPlugin::checkShapes(InputDims inputDims, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    try
    {
        std::string error = nbOutputs == kNbOutputs ? "" : "expected 3 outputs, got " + std::to_string(nbOutputs);
        if (error.empty() && nbInputs != kNbInputs)
        {
            error = "expected 5 inputs, got " + std::to_string(nbInputs);
        }
        if (error.empty())
        {
            Dims dims[kNbInputs];
            for (int32_t i = 0; i < kNbInputs; ++i)
            {
                dims[i] = inputDims(i);
            }
            error = shapeError(dims);
        }
        if (error.empty())
        {
            return 0;
        }
        logPluginError(error, kTreePluginName);
    }
    catch (std::exception const& e)
    {
        logPluginError(e.what(), kTreePluginName);
    }
    return -1;
}

IPluginCapability* DFlashTreeAcceptPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    return capabilityOf(this, type);
}

IPluginV3* DFlashTreeAcceptPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<DFlashTreeAcceptPlugin>().release();
    }
    catch (std::exception const& e)
    {
        logPluginError(std::string("clone failed: ") + e.what(), kTreePluginName);
    }
    return nullptr;
}

char const* DFlashTreeAcceptPlugin::getPluginName() const noexcept
{
    return kTreePluginName;
}

char const* DFlashTreeAcceptPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* DFlashTreeAcceptPlugin::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

int32_t DFlashTreeAcceptPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t DFlashTreeAcceptPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /* inputTypes */, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        logPluginError("expected 5 inputs and 3 outputs", kTreePluginName);
        return -1;
    }
    for (int32_t i = 0; i < kNbOutputs; ++i)
    {
        outputTypes[i] = DataType::kINT32;
    }
    return 0;
}

int32_t DFlashTreeAcceptPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& /* exprBuilder */) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[kTargetLogits].nbDims != 3)
    {
        logPluginError("expected 5 inputs with target_logits of rank 3, and 3 outputs", kTreePluginName);
        return -1;
    }
    outputs[kPathNodes].nbDims = 2;
    outputs[kPathNodes].d[0] = inputs[kTargetLogits].d[0];
    outputs[kPathNodes].d[1] = inputs[kTargetLogits].d[1];
    for (int32_t o : {kPathLength, kBonus})
    {
        outputs[o].nbDims = 1;
        outputs[o].d[0] = inputs[kTargetLogits].d[0];
    }
    return 0;
}

bool DFlashTreeAcceptPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    return nbInputs == kNbInputs && nbOutputs == kNbOutputs && pos >= 0 && pos < kNbInputs + kNbOutputs
        && acceptFormatSupported(pos, inOut[pos].desc, kTargetLogits, kTemperature, kGumbelNoise);
}

int32_t DFlashTreeAcceptPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /* out */,
    int32_t nbOutputs) noexcept
{
    return checkShapes([in](int32_t i) { return in[i].desc.dims; }, nbInputs, nbOutputs);
}

size_t DFlashTreeAcceptPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /* outputs */, int32_t /* nbOutputs */) const noexcept
{
    // Every node's t for the rows-in-parallel schedule, at the largest batch and tree the profile allows.
    if (nbInputs != kNbInputs || inputs[kTargetLogits].max.nbDims != 3)
    {
        return 0;
    }
    return dflashTreeAcceptWorkspaceSize(inputs[kTargetLogits].max.d[0], inputs[kTargetLogits].max.d[1]);
}

int32_t DFlashTreeAcceptPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept
{
    return checkShapes([in](int32_t i) { return in[i].dims; }, nbInputs, nbOutputs);
}

int32_t DFlashTreeAcceptPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /* outputDesc */,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    // Shapes were checked in onShapeChange, which TensorRT calls before the first enqueue of each shape.
    DFlashTreeAcceptParams params{};
    params.targetLogits = inputs[kTargetLogits];
    params.temperature = static_cast<float const*>(inputs[kTemperature]);
    params.gumbelNoise = static_cast<float const*>(inputs[kGumbelNoise]);
    params.parents = static_cast<int32_t const*>(inputs[kTreeParents]);
    params.tokens = static_cast<int32_t const*>(inputs[kTreeTokens]);
    params.pathNodes = static_cast<int32_t*>(outputs[kPathNodes]);
    params.pathLength = static_cast<int32_t*>(outputs[kPathLength]);
    params.bonus = static_cast<int32_t*>(outputs[kBonus]);
    params.targets = static_cast<int32_t*>(workspace); // getWorkspaceSize's bytes (none: the per-request schedule)
    params.batchSize = static_cast<int32_t>(inputDesc[kTargetLogits].dims.d[0]);
    params.numNodes = static_cast<int32_t>(inputDesc[kTargetLogits].dims.d[1]);
    params.vocabSize = static_cast<int32_t>(inputDesc[kTargetLogits].dims.d[2]);
    if (!logitsTypeOf(inputDesc[kTargetLogits].type, params.logitsType))
    {
        logPluginError("target_logits must be float32, float16 or bfloat16", kTreePluginName);
        return -1;
    }
    cudaError_t const status = launchDFlashTreeAccept(params, stream);
    if (status != cudaSuccess)
    {
        logPluginError(std::string("kernel launch failed: ") + cudaGetErrorString(status), kTreePluginName);
        return -1;
    }
    return 0;
}

IPluginV3* DFlashTreeAcceptPlugin::attachToContext(IPluginResourceContext* /* context */) noexcept
{
    return clone();
}

PluginFieldCollection const* DFlashTreeAcceptPlugin::getFieldsToSerialize() noexcept
{
    return &mNoFields;
}

} // namespace trtllm_dflash
