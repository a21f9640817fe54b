/*
 * TensorRT IPluginV3 wrapper of the DFlash acceptance step (README.md has the interface); the creator and the
 * library's entry points are in dflash_accept_creator.cpp. The layout follows NVIDIA TensorRT's
 * plugin/topkLastDimPlugin/. Nothing here calls into libnvinfer: TensorRT's interfaces are used only
 * through their virtual methods, so the library links against the CUDA runtime alone.
 */
#include "dflash_accept_plugin.h"
#include "dflash_accept_kernel.h"
#include "plugin_common.h"

#include <exception>
#include <memory>
#include <stdexcept>

using namespace nvinfer1;

namespace trtllm_dflash
{
namespace
{

enum Input : int32_t
{
    kDraftTokens = 0,    // int32 [B, K]
    kTargetLogits = 1,   // float32 | float16 | bfloat16 [B, K+1, V]
    kTemperature = 2,    // float32 [B]
    kGumbelNoise = 3,    // float32 [B, K+1, V]
    kContextLengths = 4, // int32 [B]
    kNbInputs = 5,
};

enum Output : int32_t
{
    kAccepted = 0,          // int32 [B]
    kCommittedTokens = 1,   // int32 [B, K+1]
    kNextBlock = 2,         // int32 [B, block_size]
    kNextPositions = 3,     // int32 [B, block_size]
    kNewContextLengths = 4, // int32 [B]
    kNbOutputs = 5,
};

} // namespace

DFlashAcceptPlugin::DFlashAcceptPlugin(int32_t blockSize, int32_t maskTokenId)
    : mBlockSize(blockSize)
    , mMaskTokenId(maskTokenId)
{
    if (blockSize < 2 || blockSize > kDFlashMaxBlockSize)
    {
        throw std::invalid_argument("block_size must be in 2.." + std::to_string(kDFlashMaxBlockSize) + ", got "
            + std::to_string(blockSize));
    }
}

// The serialization fields point into the object they belong to, so a copy rebuilds its own on demand.
DFlashAcceptPlugin::DFlashAcceptPlugin(DFlashAcceptPlugin const& other)
    : DFlashAcceptPlugin(other.mBlockSize, other.mMaskTokenId)
{
}

std::string DFlashAcceptPlugin::shapeError(Dims const* dims) const
{
    int32_t const ranks[kNbInputs] = {2, 3, 1, 3, 1};
    char const* const names[kNbInputs]
        = {"draft_tokens", "target_logits", "temperature", "gumbel_noise", "context_lengths"};
    for (int32_t i = 0; i < kNbInputs; ++i)
    {
        if (dims[i].nbDims != ranks[i])
        {
            return std::string(names[i]) + " must have rank " + std::to_string(ranks[i]) + ", got shape "
                + dimsToString(dims[i]);
        }
        if (!sameOrUnknown(dims[i].d[0], dims[kDraftTokens].d[0]))
        {
            return std::string(names[i]) + " has batch " + std::to_string(dims[i].d[0]) + ", draft_tokens has "
                + std::to_string(dims[kDraftTokens].d[0]);
        }
    }
    Dims const& logits = dims[kTargetLogits];
    if (!sameOrUnknown(dims[kDraftTokens].d[1], mBlockSize - 1) || !sameOrUnknown(logits.d[1], mBlockSize))
    {
        return "block_size is " + std::to_string(mBlockSize) + ", so draft_tokens must be [B, "
            + std::to_string(mBlockSize - 1) + "] and target_logits [B, " + std::to_string(mBlockSize)
            + ", V]; got " + dimsToString(dims[kDraftTokens]) + " and " + dimsToString(logits);
    }
    Dims const& noise = dims[kGumbelNoise];
    if (!sameOrUnknown(noise.d[1], logits.d[1]) || !sameOrUnknown(noise.d[2], logits.d[2]))
    {
        return "gumbel_noise " + dimsToString(noise) + " must have the shape of target_logits " + dimsToString(logits);
    }
    if (logits.d[2] == 0 || logits.d[2] > kDFlashMaxVocabSize)
    {
        return "vocabulary size " + std::to_string(logits.d[2]) + " is outside 1.."
            + std::to_string(kDFlashMaxVocabSize);
    }
    return {};
}

template <typename InputDims>
int32_t DFlashAcceptPlugin::checkShapes(InputDims inputDims, int32_t nbInputs, int32_t nbOutputs) const noexcept
{
    try
    {
        std::string error = nbOutputs == kNbOutputs ? "" : "expected 5 outputs, got " + std::to_string(nbOutputs);
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
        logPluginError(error);
    }
    catch (std::exception const& e)
    {
        logPluginError(e.what());
    }
    return -1;
}

// IPluginV3

IPluginCapability* DFlashAcceptPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    return capabilityOf(this, type);
}

IPluginV3* DFlashAcceptPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<DFlashAcceptPlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        logPluginError(std::string("clone failed: ") + e.what());
    }
    return nullptr;
}

// IPluginV3OneCore

char const* DFlashAcceptPlugin::getPluginName() const noexcept
{
    return kPluginName;
}

char const* DFlashAcceptPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* DFlashAcceptPlugin::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

// IPluginV3OneBuild

int32_t DFlashAcceptPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t DFlashAcceptPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /* inputTypes */, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        logPluginError("expected 5 inputs and 5 outputs");
        return -1;
    }
    for (int32_t i = 0; i < kNbOutputs; ++i)
    {
        outputTypes[i] = DataType::kINT32;
    }
    return 0;
}

int32_t DFlashAcceptPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    // The rest of the shapes (K = block_size - 1 included) is checked in configurePlugin and onShapeChange.
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[kDraftTokens].nbDims != 2)
    {
        logPluginError("expected 5 inputs with draft_tokens of rank 2, and 5 outputs");
        return -1;
    }
    IDimensionExpr const* batch = inputs[kDraftTokens].d[0];
    IDimensionExpr const* blockSize = exprBuilder.constant(mBlockSize);
    for (int32_t o : {kAccepted, kNewContextLengths})
    {
        outputs[o].nbDims = 1;
        outputs[o].d[0] = batch;
    }
    for (int32_t o : {kCommittedTokens, kNextBlock, kNextPositions})
    {
        outputs[o].nbDims = 2;
        outputs[o].d[0] = batch;
        outputs[o].d[1] = blockSize;
    }
    return 0;
}

bool DFlashAcceptPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    return nbInputs == kNbInputs && nbOutputs == kNbOutputs && pos >= 0 && pos < kNbInputs + kNbOutputs
        && acceptFormatSupported(pos, inOut[pos].desc, kTargetLogits, kTemperature, kGumbelNoise);
}

int32_t DFlashAcceptPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /* out */,
    int32_t nbOutputs) noexcept
{
    return checkShapes([in](int32_t i) { return in[i].desc.dims; }, nbInputs, nbOutputs);
}

size_t DFlashAcceptPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /* inputs */, int32_t /* nbInputs */,
    DynamicPluginTensorDesc const* /* outputs */, int32_t /* nbOutputs */) const noexcept
{
    return 0;
}

// IPluginV3OneRuntime

int32_t DFlashAcceptPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept
{
    return checkShapes([in](int32_t i) { return in[i].dims; }, nbInputs, nbOutputs);
}

int32_t DFlashAcceptPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /* outputDesc */,
    void const* const* inputs, void* const* outputs, void* /* workspace */, cudaStream_t stream) noexcept
{
    // Shapes were checked in onShapeChange, which TensorRT calls before the first enqueue of each shape.
    DFlashAcceptParams params{};
    params.draftTokens = static_cast<int32_t const*>(inputs[kDraftTokens]);
    params.targetLogits = inputs[kTargetLogits];
    params.temperature = static_cast<float const*>(inputs[kTemperature]);
    params.gumbelNoise = static_cast<float const*>(inputs[kGumbelNoise]);
    params.contextLengths = static_cast<int32_t const*>(inputs[kContextLengths]);
    params.accepted = static_cast<int32_t*>(outputs[kAccepted]);
    params.committedTokens = static_cast<int32_t*>(outputs[kCommittedTokens]);
    params.nextBlock = static_cast<int32_t*>(outputs[kNextBlock]);
    params.nextPositions = static_cast<int32_t*>(outputs[kNextPositions]);
    params.newContextLengths = static_cast<int32_t*>(outputs[kNewContextLengths]);
    params.batchSize = static_cast<int32_t>(inputDesc[kDraftTokens].dims.d[0]);
    params.blockSize = mBlockSize;
    params.vocabSize = static_cast<int32_t>(inputDesc[kTargetLogits].dims.d[2]);
    params.maskTokenId = mMaskTokenId;
    if (!logitsTypeOf(inputDesc[kTargetLogits].type, params.logitsType))
    {
        logPluginError("target_logits must be float32, float16 or bfloat16");
        return -1;
    }
    cudaError_t const status = launchDFlashAccept(params, stream);
    if (status != cudaSuccess)
    {
        logPluginError(std::string("kernel launch failed: ") + cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

IPluginV3* DFlashAcceptPlugin::attachToContext(IPluginResourceContext* /* context */) noexcept
{
    return clone();
}

PluginFieldCollection const* DFlashAcceptPlugin::getFieldsToSerialize() noexcept
{
    mFieldsToSerialize.clear();
    mFieldsToSerialize.emplace_back(kBlockSizeField, &mBlockSize, PluginFieldType::kINT32, 1);
    mFieldsToSerialize.emplace_back(kMaskTokenIdField, &mMaskTokenId, PluginFieldType::kINT32, 1);
    mCollectionToSerialize.nbFields = static_cast<int32_t>(mFieldsToSerialize.size());
    mCollectionToSerialize.fields = mFieldsToSerialize.data();
    return &mCollectionToSerialize;
}

} // namespace trtllm_dflash
